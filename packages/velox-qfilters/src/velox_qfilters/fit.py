"""Fitting Q-Filters: the principal direction of each head's post-RoPE queries.

Q-Filters (arXiv 2503.02812, Sec. 4): run the model on calibration text, gather each query
head's post-RoPE queries, take the first right singular vector ``v`` of the matrix of a random
sample of them (the authors use 3,000), and orient it so that the majority of the sampled
queries project positively on it (the authors' ``make_filters.py``: sign +1 when more than
half of the first left singular vector's entries are positive). The filter of a KV head is the
mean of the oriented vectors of the query heads that share it (grouped-query attention).

The first right singular vector of ``Q`` is the top eigenvector of ``QᵀQ``; it is computed
that way here (a ``D x D`` eigenproblem instead of an SVD with a ``samples x samples`` left
factor): the same vector, a deviation in computation only. Sequences shorter than ``seq_len``
(the tail of the calibration tokens) are used too; the authors skip short documents.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import numpy as np

from velox_core import RetentionPolicy, VeloxCache, make_cache, routed
from velox_core.artifacts import Calibration
from velox_core.validation import check_int

from .artifact import Filters

__all__ = ["fit_filters", "principal_filters"]


def principal_filters(queries: mx.array, kv_heads: int) -> mx.array:
    """Q-Filters of one layer from sampled queries.

    Shapes:
        queries ``(Hq, S, D)`` (post-RoPE, any float dtype); returns float32 ``(kv_heads, D)``:
        the oriented first right singular vector of each query head, averaged over the
        ``Hq // kv_heads`` consecutive query heads of each KV head.
    """
    if queries.ndim != 3 or queries.shape[1] < 1:
        raise ValueError(f"queries must be (Hq, S, D) with S >= 1, got {tuple(queries.shape)}")
    hq, _, d = queries.shape
    check_int("kv_heads", kv_heads, minimum=1)
    if hq % kv_heads:
        raise ValueError(f"kv_heads={kv_heads} must divide the {hq} query heads")
    q = queries.astype(mx.float32)
    gram = mx.swapaxes(q, 1, 2) @ q  # (Hq, D, D)
    _, vecs = mx.linalg.eigh(gram, stream=mx.cpu)  # eigenvalues ascending
    v = vecs[:, :, -1]  # (Hq, D)
    proj = (q @ v[:, :, None])[:, :, 0]  # (Hq, S)
    sign = mx.where(mx.mean(proj > 0, axis=1) > 0.5, 1.0, -1.0)
    f = sign[:, None] * v
    return mx.mean(f.reshape(kv_heads, hq // kv_heads, d), axis=1)


class _Recorder(RetentionPolicy):
    """Keeps the queries of the sampled positions (``want``) seen by one layer's attention."""

    name = "qfilters-recorder"

    def __init__(self, store: dict, layer: int, want: dict):
        super().__init__()
        self.store, self.layer, self.want = store, layer, want

    def observe(self, view, queries: mx.array, scale: float) -> None:
        n = queries.shape[2]
        start = view.offset - n
        pos = self.want["pos"]
        sel = pos[(pos >= start) & (pos < start + n)] - start
        if sel.size:
            picked = queries[0][:, mx.array(sel)].astype(mx.float32)  # (Hq, s, D)
            self.store.setdefault(self.layer, {"q": [], "kv": view.kv_heads})["q"].append(picked)


def fit_filters(
    model: Any,
    tokenizer_or_token_ids: Any,
    text: str | list[str] | None = None,
    *,
    max_tokens: int | None = 8192,
    seq_len: int = 2048,
    samples: int = 3000,
    seed: int = 0,
    chunk: int = 512,
    source: str | None = None,
) -> Filters:
    """Fit the Q-Filters of ``model`` on calibration text.

    Args:
        seq_len: the tokens are cut into sequences of this length, each run from position 0.
        samples: query positions sampled (uniformly, without replacement) for the SVD.
        seed: seed of that sample.
        model, tokenizer_or_token_ids, text, max_tokens, chunk, source: the model (run as it
            is: cast it first to fit in another dtype) and its calibration
            (:class:`velox_core.artifacts.Calibration`).

    Returns:
        :class:`Filters` with one float32 ``(H_kv, D)`` array per attention layer.
    """
    cal = Calibration.of(
        tokenizer_or_token_ids, text, "fit_filters", max_tokens, seq_len, chunk, source
    )
    ids = cal.ids
    check_int("samples", samples, minimum=1)
    check_int("seed", seed, minimum=0)
    rng = np.random.default_rng(seed)
    pick = np.sort(rng.choice(ids.size, size=min(samples, ids.size), replace=False))
    store: dict = {}
    want = {"pos": pick[:0]}
    for s in range(0, ids.size, seq_len):
        seq = mx.array(ids[s : s + seq_len])[None]
        want["pos"] = pick[(pick >= s) & (pick < s + seq_len)] - s
        caches = make_cache(model, lambda i: VeloxCache(policy=_Recorder(store, i, want)))
        with routed(model):
            for c in range(0, seq.shape[1], chunk):
                model(seq[:, c : c + chunk], cache=caches)
                mx.eval([q for rec in store.values() for q in rec["q"]])
    if not store:
        raise ValueError("fit_filters: no attention layer was observed (no velox-cached layers?)")
    layers = {
        i: principal_filters(mx.concatenate(rec["q"], axis=1), rec["kv"])
        for i, rec in sorted(store.items())
    }
    mx.eval(layers)
    provenance = cal.fitted(model, samples=int(pick.size), seed=seed)
    return Filters(layers, **provenance)
