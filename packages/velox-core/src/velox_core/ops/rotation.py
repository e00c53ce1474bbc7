"""Seeded random orthogonal rotations (Haar-distributed), for any dimension."""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from ..validation import check_int

__all__: list[str] = []


def random_orthogonal(dim: int, seed: int = 0) -> mx.array:
    """A Haar-random orthogonal matrix from a seeded QR decomposition.

    Generated with numpy's PCG64 so the same seed gives the same matrix on every platform.
    The sign fix ``Q * sign(diag(R))`` makes the distribution exactly Haar.

    Shapes:
        returns ``(dim, dim)`` float32 ``Q`` with ``Q @ Q.T == I``; rotate with ``x @ Q.T``.
    """
    check_int("dim", dim, minimum=1)
    check_int("seed", seed, minimum=0)
    rng = np.random.default_rng(seed)
    a = rng.standard_normal((dim, dim))
    q, r = np.linalg.qr(a)
    q = q * np.sign(np.diag(r))[None, :]
    return mx.array(q.astype(np.float32))
