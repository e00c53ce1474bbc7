"""CurDKV's token scores: approximate leverage scores of the keys and of the values.

CUR decomposition keeps the rows of a matrix with the highest leverage scores (the squared
row norms of an orthonormal basis of its dominant subspace). CurDKV (arXiv 2509.15038)
approximates them cheaply, per KV head: the keys ``K`` and the values ``V`` ``(T, D)`` are
projected by one Gaussian matrix ``G`` ``(D, r)`` with entries ``N(0, 1/r)``, and the
squared row norms of ``K G`` and ``V G`` stand for the key and the value leverage scores
(``sketch=0`` skips the projection: the exact squared norms). Each is normalised within
local windows of ``local`` consecutive positions (aligned to absolute position 0: the
windows ``[0, local)``, ``[local, 2 local)``, ...), so a token competes with its
neighbours rather than with the whole context; the token's score is the product of its key
and its value score. A token whose value is large is kept even where its key alone would
lose: the value is what the attention output carries.
"""

from __future__ import annotations

import math

import mlx.core as mx
import numpy as np

__all__ = ["gaussian_sketch", "leverage_scores", "local_normalize"]


def gaussian_sketch(dim: int, rank: int, seed: int) -> mx.array:
    """The random projection ``G``: float32 ``(dim, rank)``, entries ``N(0, 1/rank)``,
    drawn from ``numpy.random.default_rng(seed).standard_normal((dim, rank))``."""
    g = np.random.default_rng(seed).standard_normal((dim, rank)) / math.sqrt(rank)
    return mx.array(g.astype(np.float32))


def local_normalize(x: mx.array, positions: mx.array, local: int, windows: int) -> mx.array:
    """Divide each score by the sum of the scores of its local window.

    Args:
        x: non-negative scores, float32 ``(B, T)``.
        positions: absolute positions of the tokens, int ``(B, T)``; the window of a token
            is ``position // local``.
        local: positions per window (0: one window, the whole row).
        windows: more than the largest window index (e.g. ``offset // local + 1``).

    Returns:
        float32 ``(B, T)``; a window whose scores are all zero keeps zeros.
    """
    if local == 0:
        total = mx.sum(x, axis=-1, keepdims=True)
        return x / mx.maximum(total, 1e-30)
    b, t = x.shape
    ids = positions.astype(mx.int32) // local + windows * mx.arange(b, dtype=mx.int32)[:, None]
    flat = ids.reshape(-1)
    sums = mx.zeros((b * windows,), dtype=mx.float32).at[flat].add(x.reshape(-1))
    return x / mx.maximum(sums[flat].reshape(b, t), 1e-30)


def leverage_scores(
    keys: mx.array,
    values: mx.array,
    positions: mx.array,
    key_sketch: mx.array | None,
    value_sketch: mx.array | None,
    local: int,
    windows: int,
) -> mx.array:
    """CurDKV's score of each token of one KV head: key leverage times value leverage.

    Args:
        keys: ``(B, T, D)``, values ``(B, T, Dv)``, any float dtype (scored in float32).
        positions: absolute positions, int ``(B, T)`` (they place the local windows).
        key_sketch, value_sketch: ``G`` ``(D, r)`` and ``(Dv, r)`` (one matrix where
            ``Dv == D``), or None for the exact squared norms.
        local: positions per normalisation window (0: the whole row).
        windows: more than the largest window index.

    Returns:
        float32 ``(B, T)``, higher is kept first.
    """
    k, v = keys.astype(mx.float32), values.astype(mx.float32)
    if key_sketch is not None:
        k, v = k @ key_sketch, v @ value_sketch
    k2 = local_normalize(mx.sum(k * k, axis=-1), positions, local, windows)
    v2 = local_normalize(mx.sum(v * v, axis=-1), positions, local, windows)
    return k2 * v2
