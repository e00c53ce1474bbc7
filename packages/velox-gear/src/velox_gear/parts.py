"""GEAR's building blocks: the outliers' selection and the residual's low-rank solver."""

from __future__ import annotations

import mlx.core as mx

__all__ = ["grid", "lowrank", "orthonormal", "outlier_index"]


def orthonormal(m: mx.array) -> mx.array:
    """Orthonormal columns spanning ``m``'s (Gram-Schmidt, twice); zero columns stay zero.

    Shapes:
        m float32 ``(..., n, r)``; returns float32 ``(..., n, r)``.
    """
    cols: list[mx.array] = []
    for j in range(m.shape[-1]):
        c = m[..., j]
        for _ in range(2):
            for u in cols:
                c = c - mx.sum(c * u, axis=-1, keepdims=True) * u
        norm = mx.linalg.norm(c, axis=-1, keepdims=True)
        cols.append(mx.where(norm > 1e-20, c / mx.maximum(norm, 1e-20), 0.0))
    return mx.stack(cols, axis=-1)


def lowrank(e: mx.array, rank: int, iters: int, seed: int) -> tuple[mx.array, mx.array]:
    """Rank-``rank`` factors of each matrix by ``iters`` subspace (power) iterations from
    a seeded uniform start.

    Shapes:
        e float32 ``(..., n, d)``; returns ``A`` float32 ``(..., n, rank)`` (orthonormal
        columns) and ``B`` float32 ``(..., d, rank)``, with ``e ~ A @ B.T``.
    """
    # one seeded start shared by every matrix: a row's factors do not depend on its batch
    start = mx.random.uniform(shape=(e.shape[-1], rank), key=mx.random.key(seed))
    p = mx.broadcast_to(start, (*e.shape[:-2], e.shape[-1], rank))
    et = mx.swapaxes(e, -1, -2)
    for _ in range(iters):
        a = orthonormal(e @ orthonormal(p))
        p = et @ a
    return a, p


def outlier_index(flat: mx.array, k: int) -> mx.array:
    """The ``k`` largest and then the ``k`` smallest entries of each row, distinct.

    Shapes:
        flat float32 ``(..., n)`` with ``2k <= n``; returns int32 ``(..., 2k)``.
    """
    big = mx.argpartition(-flat, kth=k - 1, axis=-1)[..., :k]
    rest = mx.put_along_axis(flat, big, mx.array(float("inf")), axis=-1)
    small = mx.argpartition(rest, kth=k - 1, axis=-1)[..., :k]
    return mx.concatenate([big, small], axis=-1).astype(mx.int32)


def grid(*shape: int) -> list[mx.array]:
    """Broadcastable ``arange`` index arrays for the leading axes of an ``.at`` update."""
    n = len(shape) + 1
    return [mx.arange(s).reshape(*([1] * i), s, *([1] * (n - i - 1))) for i, s in enumerate(shape)]
