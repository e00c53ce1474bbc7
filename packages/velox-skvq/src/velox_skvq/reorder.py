"""Channel reordering (SKVQ, arXiv 2405.06219): channels of similar range share a group.

SKVQ clusters the channels of a layer's keys (and, separately, values) by their calibration
minimum and maximum with k-means, ``channels / group`` clusters, and permutes the channels so
that each cluster is contiguous. The reference code lets clusters have any size; here every
cluster holds exactly ``group`` channels (balanced k-means), so the groups stay uniform and the
codes stay readable by ``mx.quantized_matmul``. Among the partitions met along the way (the
model's own order, channels sorted by range, every balanced k-means iterate), the one with the
least sum of squared group ranges is kept: the quantization step of a group grows with its
range, so this is the proxy of the quantization error that the clustering aims at.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

__all__ = ["fit_permutation", "from_chunks", "group_cost", "slots", "to_chunks"]

_ITERS = 12


def group_cost(lo: np.ndarray, hi: np.ndarray, labels: np.ndarray, k: int) -> float:
    """Sum over clusters of the squared range ``(max hi - min lo)**2``."""
    top = np.full(k, -np.inf)
    bot = np.full(k, np.inf)
    np.maximum.at(top, labels, hi)
    np.minimum.at(bot, labels, lo)
    return float(np.sum((top - bot) ** 2))


def _balanced_assign(dist: np.ndarray, size: int) -> np.ndarray:
    """Each point to a near cluster, every cluster taking exactly ``size`` points.

    In rounds, each unassigned point proposes its nearest cluster with room left, and each
    cluster accepts its closest proposers up to its room (at most one round per cluster).
    """
    n, k = dist.shape
    labels = np.full(n, -1)
    room = np.full(k, size)
    while (labels < 0).any():
        free = np.nonzero(labels < 0)[0]
        d = np.where(room[None, :] > 0, dist[free], np.inf)
        choice = np.argmin(d, axis=1)
        order = np.lexsort((d[np.arange(len(free)), choice], choice))
        ch = choice[order]
        rank = np.arange(len(order)) - np.searchsorted(ch, ch, side="left")
        ok = rank < room[ch]
        labels[free[order[ok]]] = ch[ok]
        room -= np.bincount(ch[ok], minlength=k)
    return labels


def _labels_from_order(order: np.ndarray, size: int) -> np.ndarray:
    labels = np.empty(len(order), dtype=np.int64)
    labels[order] = np.arange(len(order)) // size
    return labels


def fit_permutation(lo: np.ndarray, hi: np.ndarray, group: int) -> np.ndarray:
    """A channel order whose consecutive runs of ``group`` channels have similar ranges.

    Args:
        lo, hi: ``(N,)`` per-channel minimum and maximum over the calibration tokens.
        group: channels per group; must divide ``N``.

    Returns:
        ``perm`` ``(N,)`` int64: slot ``p`` of the reordered vector holds channel ``perm[p]``.
    """
    n = lo.shape[0]
    if n % group:
        raise ValueError(f"group={group} must divide the {n} channels")
    k = n // group
    lo, hi = lo.astype(np.float64), hi.astype(np.float64)
    pts = np.stack([lo, hi], axis=1)
    candidates = [
        np.arange(n) // group,  # the model's own order
        _labels_from_order(np.argsort(hi - lo, kind="stable"), group),
    ]
    labels = candidates[-1]
    for _ in range(_ITERS if k > 1 else 0):
        cent = np.stack([pts[labels == c].mean(axis=0) for c in range(k)])
        dist = np.sum((pts[:, None, :] - cent[None]) ** 2, axis=-1)
        new = _balanced_assign(dist, group)
        candidates.append(new)
        if np.array_equal(new, labels):
            break
        labels = new
    costs = [group_cost(lo, hi, lab, k) for lab in candidates]
    best = candidates[int(np.argmin(costs))]
    # groups ordered by their range, channels ascending inside a group
    rng = np.array([hi[best == c].max() - lo[best == c].min() for c in range(k)])
    rank = np.empty(k, dtype=np.int64)
    rank[np.argsort(rng, kind="stable")] = np.arange(k)
    return np.lexsort((np.arange(n), rank[best]))


def slots(perm: mx.array) -> mx.array:
    """``pos`` ``(B, N)``: the slot of the reordered vector that holds channel ``c``."""
    return mx.argsort(perm.astype(mx.int32), axis=-1)


def to_chunks(x: mx.array, perm: mx.array) -> mx.array:
    """Reorder a layer's channels, heads mixed, and cut the result back into ``H`` chunks.

    Shapes:
        x ``(B, H, T, D)`` in model order, perm ``(B, H*D)``; returns ``(B, H, T, D)``, chunk
        ``j`` holding slots ``j*D`` to ``j*D + D - 1`` of the reordered vector.
    """
    b, h, t, d = x.shape
    flat = mx.swapaxes(x, 1, 2).reshape(b, t, h * d)
    flat = mx.take_along_axis(flat, perm.astype(mx.int32)[:, None, :], axis=-1)
    return mx.swapaxes(flat.reshape(b, t, h, d), 1, 2)


def from_chunks(x: mx.array, perm: mx.array) -> mx.array:
    """Inverse of :func:`to_chunks`. Shapes: as :func:`to_chunks`."""
    b, h, t, d = x.shape
    flat = mx.swapaxes(x, 1, 2).reshape(b, t, h * d)
    flat = mx.take_along_axis(flat, slots(perm)[:, None, :], axis=-1)
    return mx.swapaxes(flat.reshape(b, t, h, d), 1, 2)
