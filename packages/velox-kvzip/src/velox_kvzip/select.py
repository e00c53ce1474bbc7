"""Which context pairs KVzip keeps, from every layer's scores (arXiv 2505.23416, section 3).

``heads="global"`` ranks every body pair of every KVzip layer and KV head together and keeps
the best ``sum over layers of quota x H`` (the paper's and kvpress's default: head- and
layer-wise budgets fall where the scores are); ``"layer"`` ranks each layer's pairs over its
heads (kvpress's ``layerwise=True``); ``"uniform"`` keeps the best ``quota`` of each KV head
(the paper's uniform head budget). A layer whose heads keep different counts is stored per
head (``VeloxCache.evict`` with one index array per head: batch 1, routed attention).
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from velox_core.policy import top_k_sorted

__all__ = ["keep_sets"]


def keep_sets(heads: str, scores: list[mx.array], quotas: list[int]) -> list:
    """The body tokens each layer keeps.

    Args:
        heads: ``"global"``, ``"layer"`` or ``"uniform"``.
        scores: per layer, float32 ``(B, H_l, T_l)``: each body pair's score (``B`` 1 for
            ``"global"`` and ``"layer"``).
        quotas: per layer, body tokens kept per KV head (on average over the ranking's heads).

    Returns:
        per layer, what ``VeloxCache.evict`` takes: int32 ``(B, H_l, k)`` (every head keeps
        ``k``), or a list of ``H_l`` ascending int32 arrays (counts differ by head), or None
        (the layer keeps every body token).
    """
    if heads == "uniform":
        return [None if q >= s.shape[2] else top_k_sorted(s, q) for s, q in zip(scores, quotas)]
    flat = [np.array(s[0].astype(mx.float32)).reshape(-1) for s in scores]
    want = [min(q * s.shape[1], f.size) for s, q, f in zip(scores, quotas, flat)]
    if heads == "layer":
        masks = [_top(f, k) for f, k in zip(flat, want)]
    else:
        everything = _top(np.concatenate(flat), sum(want))
        masks = np.split(everything, np.cumsum([f.size for f in flat])[:-1])
    out = []
    for s, m in zip(scores, masks):
        m = m.reshape(s.shape[1], s.shape[2])
        counts = m.sum(axis=1)
        if counts.min() == s.shape[2]:
            out.append(None)
        elif counts.min() == counts.max():  # one count: dense per-head storage
            idx = np.stack([np.flatnonzero(row) for row in m])
            out.append(mx.array(idx[None].astype(np.int32)))
        else:
            out.append([mx.array(np.flatnonzero(row).astype(np.int32)) for row in m])
    return out


def _top(x: np.ndarray, k: int) -> np.ndarray:
    """Boolean mask of the ``k`` largest entries of ``x`` (ties broken arbitrarily)."""
    mask = np.zeros(x.size, dtype=bool)
    if k >= x.size:
        mask[:] = True
    elif k > 0:
        mask[np.argpartition(-x, k - 1)[:k]] = True
    return mask
