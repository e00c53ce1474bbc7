"""Batched k-means (k-means++ seeding, Lloyd iterations) for VQ codebooks."""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from ..validation import check_array, check_int

__all__: list[str] = []

# Distance entries (vectors x centroids) per group in one block of an assignment on the CPU, in
# MLX and in numpy: a block's distances stay in cache between the matmul that writes them and the
# argmin that reads them (measured on a 2-core x86 CPU, G = 2..32, N = 8k..16k, k = 256). The
# rows of a block depend on k alone, so that a group's assignment does not depend on the others.
_MLX_CPU_BLOCK = 1 << 14
_CPU_BLOCK = 1 << 16
# Values per block of the k-means++ seeding's two-level search (see _seed).
_SEED_BLOCK = 256


def _nearest(x: mx.array, ct: mx.array, cn: mx.array) -> mx.array:
    """argmin of ``|c|^2 - 2 x.c`` over the centroids, given ``ct = (-2 c)^T`` and ``cn = |c|^2``
    (``x @ ct`` is ``-2 (x @ c^T)`` exactly: the distances :func:`assign` always formed)."""
    return mx.argmin(cn + x @ ct, axis=-1)


def assign(x: mx.array, centroids: mx.array) -> mx.array:
    """Index of the nearest centroid for each vector (the first of equals).

    On the CPU the distances are formed and reduced in blocks of rows that stay in cache.

    Shapes:
        x ``(G, N, D)``, centroids ``(G, K, D)``; returns uint32 ``(G, N)``.
    """
    n = x.shape[1]
    cn = mx.sum(centroids * centroids, axis=-1)[:, None, :]
    ct = mx.swapaxes(centroids * -2, -1, -2)
    step = n
    if mx.default_device() == mx.cpu:
        step = max(1, _MLX_CPU_BLOCK // max(1, centroids.shape[-2]))
    if n <= step:
        return _nearest(x, ct, cn).astype(mx.uint32)
    parts = [_nearest(x[:, i : i + step], ct, cn) for i in range(0, n, step)]
    return mx.concatenate(parts, axis=1).astype(mx.uint32)


def _sum_terms(terms: list[np.ndarray]) -> np.ndarray:
    """``terms[0] + ... + terms[-1]`` elementwise, added in the order ``np.sum(axis=-1)`` adds
    ``len(terms) < 128`` contiguous values (numpy's pairwise summation: one running sum below
    8 values, else 8 running sums combined as a tree, then the remainder), so that a sum over
    the leading axis of a transposed array equals the sum over the last axis of the original.
    Overwrites the terms."""
    m = len(terms)
    if m < 8:
        out = terms[0]
        for t in terms[1:]:
            out += t
        return out
    r = terms[:8]
    tail = m - m % 8
    for i in range(8, tail, 8):
        for j in range(8):
            r[j] += terms[i + j]
    r[0] += r[1]
    r[2] += r[3]
    r[4] += r[5]
    r[6] += r[7]
    r[0] += r[2]
    r[4] += r[6]
    r[0] += r[4]
    for t in terms[tail:]:
        r[0] += t
    return r[0]


def _seed(xs: np.ndarray, k: int, seed: int) -> np.ndarray:
    """k-means++ centres of every group, as one numpy loop per group would pick them.

    The reference is, per group in order, with one generator: ``c = [pts[rng.integers(n)]]``,
    ``d2 = sum((pts - c) ** 2, -1)``, then ``k - 1`` times ``c.append(pts[rng.choice(n, p=d2 /
    d2.sum())])`` (uniform where ``d2.sum()`` is 0) and ``d2 = minimum(d2, sum((pts - c[-1]) **
    2, -1))``. ``choice`` draws one double ``u`` and returns the first index whose float64
    cumulative sum of its float32 ``p``, divided by the last, exceeds ``u``. Here every group's
    draws are taken up front (``integers`` then ``k - 1`` doubles: the same stream) and the groups
    advance together. ``d2``, its float32 sum and ``p`` are computed as the reference computes
    them (:func:`_sum_terms`); the index is found in two levels, the first block of
    :data:`_SEED_BLOCK` values whose float64 cumulative sum exceeds ``u`` times the total, then
    the index inside it, instead of one sequential cumulative sum over all ``N`` (the slowest
    step). The two searches agree but where ``u`` falls within float64 rounding of a boundary;
    where the second finds no index (a block sum rounded across ``u``) the reference's search
    runs for that group.

    Shapes:
        xs ``(G, N, D)`` float32; returns ``(G, k, D)`` float32.
    """
    g, n, d = xs.shape
    rng = np.random.default_rng(seed)
    first = np.empty(g, dtype=np.int64)
    draws = np.empty((g, k - 1))
    for i in range(g):
        first[i] = rng.integers(n)
        draws[i] = rng.random(k - 1)
    rows = np.arange(g)
    cents = np.empty((g, k, d), dtype=np.float32)
    cents[:, 0] = xs[rows, first]
    if k == 1:
        return cents
    xt = np.ascontiguousarray(xs.transpose(2, 0, 1)) if d < 128 else None  # (D, G, N)

    def dist(c: np.ndarray) -> np.ndarray:  # c (G, D) -> squared distances (G, N)
        if xt is None:
            return np.sum((xs - c[:, None, :]) ** 2, axis=-1)
        terms = [xt[j] - c[:, j, None] for j in range(d)]
        for t in terms:
            np.square(t, out=t)
        return _sum_terms(terms)

    d2 = dist(cents[:, 0])
    nb = -(-n // _SEED_BLOCK)
    p = np.zeros((g, nb * _SEED_BLOCK), dtype=np.float32)  # zeros past n: never picked
    blocks = p.reshape(g, nb, _SEED_BLOCK)
    uniform = np.cumsum(np.full(n, 1.0 / n))
    uniform /= uniform[-1]
    for j in range(1, k):
        u = draws[:, j - 1]
        total = d2.sum(axis=-1)
        with np.errstate(divide="ignore", invalid="ignore"):
            np.divide(d2, total[:, None], out=p[:, :n])
        bcdf = np.cumsum(blocks.sum(axis=-1, dtype=np.float64), axis=-1)  # (G, nb)
        t = u * bcdf[:, -1]
        blk = np.count_nonzero(bcdf <= t[:, None], axis=-1)
        b = np.minimum(blk, nb - 1)
        cdf = np.cumsum(blocks[rows, b], axis=-1, dtype=np.float64)  # (G, block)
        cdf += np.where(b > 0, bcdf[rows, b - 1], 0.0)[:, None]
        at = np.count_nonzero(cdf <= t[:, None], axis=-1)
        idx = b * _SEED_BLOCK + at
        for i in np.flatnonzero(~(total > 0) | (blk >= nb) | (at >= _SEED_BLOCK)):
            if total[i] > 0:
                if total[i] == np.inf:
                    raise ValueError("kmeans: squared distances overflow float32")
                row = np.cumsum(p[i, :n], dtype=np.float64)
                row /= row[-1]
            else:
                row = uniform
            idx[i] = row.searchsorted(u[i], side="right")
        cents[:, j] = xs[rows, idx]
        if j + 1 < k:
            np.minimum(d2, dist(cents[:, j]), out=d2)
    return cents


def _assign_numpy(xs: np.ndarray, c: np.ndarray) -> np.ndarray:
    """:func:`assign` in numpy, in blocks of rows of every group (numpy's matmul and SIMD argmin
    beat MLX's on the CPU by several times on these thin matrices).

    Shapes:
        xs ``(G, N, D)``, c ``(G, K, D)`` float32; returns int64 ``(G, N)``.
    """
    g, n, _ = xs.shape
    cn = np.sum(c * c, axis=-1)[:, None, :]
    ct = (c * np.float32(-2)).transpose(0, 2, 1)
    step = max(1, _CPU_BLOCK // c.shape[1])
    a = np.empty((g, n), dtype=np.int64)
    for i in range(0, n, step):
        dd = np.matmul(xs[:, i : i + step], ct)
        dd += cn
        a[:, i : i + step] = dd.argmin(axis=-1)
    return a


def _lloyd_numpy(xs: np.ndarray, c: np.ndarray, iters: int) -> tuple[np.ndarray, np.ndarray]:
    """``iters`` Lloyd steps from ``c`` on the CPU; returns the centroids and their assignments.

    Each step's sums and counts are ``np.bincount`` over ``G * k`` bins (float64, in the vectors'
    order, so a group's result does not depend on the others); an empty cluster keeps its centroid.

    Shapes:
        xs ``(G, N, D)``, c ``(G, k, D)`` float32; returns ``(G, k, D)`` float32, int64 ``(G, N)``.
    """
    g, _, d = xs.shape
    k = c.shape[1]
    a = _assign_numpy(xs, c)
    if not iters:
        return c, a
    cols = [np.ascontiguousarray(xs[..., j]).reshape(-1) for j in range(d)]
    offset = (np.arange(g, dtype=np.int64) * k)[:, None]
    for _ in range(iters):
        bins = (a + offset).reshape(-1)
        counts = np.bincount(bins, minlength=g * k).reshape(g, k, 1)
        sums = np.stack([np.bincount(bins, col, minlength=g * k) for col in cols], axis=-1)
        mean = (sums.reshape(g, k, d) / np.maximum(counts, 1)).astype(np.float32)
        c = np.where(counts > 0, mean, c)
        a = _assign_numpy(xs, c)
    return c, a


def _split11(x: mx.array) -> tuple[mx.array, mx.array]:
    """``x = hi + rest`` exactly, ``hi`` keeping the leading 11 significant bits of ``x`` (what a
    TF32 matmul keeps of a float32 operand)."""
    hi = mx.view(mx.view(x, mx.uint32) & 0xFFFFE000, mx.float32)
    return hi, x - hi


def _lloyd_mlx(x: mx.array, c: mx.array, iters: int) -> tuple[mx.array, mx.array]:
    """:func:`_lloyd_numpy` in MLX (for the GPU).

    A step's sums and counts are one matmul of the clusters' one-hot rows ``(G, k, N)`` with the
    vectors and a column of ones: a scatter-add's atomic adds on a GPU land in any order, and a
    fit must not change from run to run. The vectors enter as three parts of at most 11
    significant bits each, which a TF32 matmul (MLX's default for float32 on CUDA) multiplies
    exactly, so the sums keep float32 precision.

    Shapes:
        x ``(G, N, D)``, c ``(G, k, D)`` float32; returns ``(G, k, D)`` float32, uint32 ``(G, N)``.
    """
    g, n, d = x.shape
    k = c.shape[1]
    a = assign(x, c)
    if not iters:
        return c, a
    hi, rest = _split11(x)
    mid, lo = _split11(rest)
    xa = mx.concatenate([hi, mid, lo, mx.ones((g, n, 1), dtype=mx.float32)], axis=-1)
    ids = mx.arange(k, dtype=mx.uint32)[None, :, None]
    for _ in range(iters):
        acc = (ids == a[:, None, :]).astype(mx.float32) @ xa  # (G, k, 3 D + 1)
        sums = (acc[..., :d] + acc[..., d : 2 * d]) + acc[..., 2 * d : 3 * d]
        counts = acc[..., 3 * d :]
        c = mx.where(counts > 0, sums / mx.maximum(counts, 1), c)
        a = assign(x, c)
    return c, a


def kmeans(x: mx.array, k: int, iters: int = 25, seed: int = 0) -> tuple[mx.array, mx.array]:
    """Cluster ``G`` independent sets of vectors into ``k`` centroids each.

    Seeding is k-means++ with numpy's seeded generator; an empty cluster keeps its centroid.
    The returned assignments are those of the returned centroids. The Lloyd steps run in numpy
    when MLX's default device is the CPU (:func:`_lloyd_numpy`), else in MLX
    (:func:`_lloyd_mlx`); a group's result does not depend on the other groups on the CPU.

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
    n = x.shape[1]
    if k > n:
        raise ValueError(f"kmeans: k={k} exceeds the number of vectors {n}")
    x = x.astype(mx.float32)
    xs = np.array(x)
    cents = _seed(xs, k, seed)
    if mx.default_device() == mx.cpu:
        with np.errstate(over="ignore", invalid="ignore"):  # as quiet as MLX on huge values
            cn, an = _lloyd_numpy(xs, cents, iters)
        c, a = mx.array(cn), mx.array(an.astype(np.uint32))
    else:
        c, a = _lloyd_mlx(x, mx.array(cents), iters)
    mx.eval(c, a)
    return (c[0], a[0]) if squeeze else (c, a)
