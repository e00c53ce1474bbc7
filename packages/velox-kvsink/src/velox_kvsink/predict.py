"""KVSink's sink predictor, on what one layer's cache sees: its keys and values.

The paper (arXiv 2508.04257) traces attention sinks to *stable outliers*: extreme activations
in a few fixed hidden-state channels that appear at an early layer on the sink tokens and
persist across the layers; it predicts the sinks from those outliers, once, for every layer.
A velox cache never sees hidden states, only its layer's post-RoPE keys and values. What the
outliers leave there: after the pre-attention RMSNorm a sink token's hidden state is
dominated by the outlier channels, so its value is *suppressed* (a small norm: the no-op
value a sink contributes) and its key is atypical (a large or distinct norm). So a token is
scored, per KV head, by how far its value norm falls below, or its key norm rises above, the
median of the layer's ordinary tokens:

    score = max over heads of max(|k| / median |k|, median |v| / |v|)

and predicted to be a sink when ``score >= outlier``.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

__all__ = ["complement", "norms", "outlier_scores", "select_sinks"]

_TINY = 1e-12


def norms(x: mx.array) -> np.ndarray:
    """L2 norm of each token's vector. Shapes: x ``(B, H, T, D)``; returns ``(B, H, T)``."""
    return np.array(mx.linalg.norm(x.astype(mx.float32), axis=-1))


def outlier_scores(
    nk: np.ndarray, nv: np.ndarray, ref_k: np.ndarray, ref_v: np.ndarray
) -> np.ndarray:
    """Each token's outlier factor: the largest over KV heads of ``|k| / median |k|`` and
    ``median |v| / |v|``.

    Shapes:
        nk, nv ``(B, H, T)`` the tokens' key and value norms; ref_k, ref_v ``(B, H, N)`` the
        reference tokens' norms (their medians per head are the baseline); returns
        ``(B, T)`` float64.
    """
    mk = np.median(ref_k, axis=2, keepdims=True).astype(np.float64)
    mv = np.median(ref_v, axis=2, keepdims=True).astype(np.float64)
    big_key = nk / np.maximum(mk, _TINY)
    small_value = mv / np.maximum(nv.astype(np.float64), _TINY)
    return np.max(np.maximum(big_key, small_value), axis=1)


def select_sinks(score: np.ndarray, outlier: float, room: int) -> np.ndarray | None:
    """The tokens to keep exact, the same number in every batch row.

    Every row keeps its tokens scoring at least ``outlier`` (``inf``: forced, the first
    tokens), highest first, at most ``room``; rows that flag fewer than the row flagging the
    most take their next highest-scoring tokens, so the rows stay the same length.

    Shapes:
        score ``(B, T)``; returns sorted token indices ``(B, n)`` int64, or None (``n == 0``).
    """
    n = min(int((score >= outlier).sum(axis=1).max(initial=0)), room)
    if n <= 0:
        return None
    top = np.argsort(-score, axis=1, kind="stable")[:, :n]
    return np.sort(top, axis=1)


def complement(picked: np.ndarray, t: int) -> np.ndarray:
    """The indices of ``range(t)`` not in ``picked``, per row, ascending.

    Shapes: picked ``(B, n)``; returns ``(B, t - n)`` int64.
    """
    keep = np.ones((picked.shape[0], t), dtype=bool)
    np.put_along_axis(keep, picked, False, axis=1)
    return np.nonzero(keep)[1].reshape(picked.shape[0], t - picked.shape[1])
