"""Batched k-means (k-means++ seeding, Lloyd iterations) for VQ codebooks."""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from ..validation import check_array, check_int

__all__ = ["assign", "kmeans"]


def assign(x: mx.array, centroids: mx.array) -> mx.array:
    """Index of the nearest centroid for each vector.

    Shapes:
        x ``(G, N, D)``, centroids ``(G, K, D)``; returns uint32 ``(G, N)``.
    """
    d = mx.sum(centroids * centroids, axis=-1)[:, None, :] - 2 * (
        x @ mx.swapaxes(centroids, -1, -2)
    )
    return mx.argmin(d, axis=-1).astype(mx.uint32)


def kmeans(x: mx.array, k: int, iters: int = 25, seed: int = 0) -> tuple[mx.array, mx.array]:
    """Cluster ``G`` independent sets of vectors into ``k`` centroids each.

    Seeding is k-means++ with numpy's seeded generator; an empty cluster keeps its centroid.

    Shapes:
        x ``(G, N, D)`` (or ``(N, D)`` for one set); returns centroids ``(G, k, D)`` float32
        and assignments ``(G, N)`` uint32 (without the leading ``G`` for 2-D input).
    """
    check_array("x", x)
    squeeze = x.ndim == 2
    if squeeze:
        x = x[None]
    if x.ndim != 3:
        raise ValueError(f"kmeans: x must be (N, D) or (G, N, D), got {tuple(x.shape)}")
    check_int("k", k, minimum=1)
    check_int("iters", iters, minimum=0)
    g, n, _ = x.shape
    if k > n:
        raise ValueError(f"kmeans: k={k} exceeds the number of vectors {n}")
    x = x.astype(mx.float32)
    xs = np.array(x)
    rng = np.random.default_rng(seed)
    cents = np.empty((g, k, x.shape[-1]), dtype=np.float32)
    for i in range(g):
        pts = xs[i]
        c = [pts[rng.integers(n)]]
        d2 = np.sum((pts - c[0]) ** 2, axis=-1)
        for _ in range(1, k):
            p = d2 / d2.sum() if d2.sum() > 0 else np.full(n, 1.0 / n)
            c.append(pts[rng.choice(n, p=p)])
            d2 = np.minimum(d2, np.sum((pts - c[-1]) ** 2, axis=-1))
        cents[i] = np.stack(c)
    c = mx.array(cents)
    a = assign(x, c)
    for _ in range(iters):
        onehot = (a[..., None] == mx.arange(k)[None, None]).astype(mx.float32)  # (G, N, k)
        counts = mx.sum(onehot, axis=1)[..., None]
        sums = mx.swapaxes(onehot, -1, -2) @ x
        c = mx.where(counts > 0, sums / mx.maximum(counts, 1), c)
        a = assign(x, c)
    mx.eval(c, a)
    return (c[0], a[0]) if squeeze else (c, a)
