"""Walsh-Hadamard transforms and randomized Hadamard rotations.

A randomized Hadamard rotation ``x -> H (s * x)`` (``s`` random signs, ``H`` the orthonormal
Walsh-Hadamard matrix) spreads the energy of a vector evenly over its coordinates in
O(d log d), which is what rotation-based quantizers (arXiv 2504.19874, 2404.00456) rely on.
Head dims that are not powers of two (80, 96, 112) use a block-diagonal Hadamard whose block
is the largest power of two dividing ``d``, after a seeded permutation that mixes blocks.
"""

from __future__ import annotations

import math

import mlx.core as mx
import numpy as np

from ..validation import check_array, check_int

__all__: list[str] = []


def _is_pow2(n: int) -> bool:
    return n > 0 and (n & (n - 1)) == 0


def block_size(dim: int) -> int:
    """Largest power of two that divides ``dim`` (the Hadamard block for that head dim)."""
    check_int("dim", dim, minimum=1)
    return dim & (-dim)


def fwht(x: mx.array) -> mx.array:
    """Orthonormal fast Walsh-Hadamard transform along the last axis (reference butterfly).

    Shapes:
        x: ``(..., n)`` with ``n`` a power of two; returns the same shape and dtype.

    It is its own inverse: ``fwht(fwht(x)) == x`` up to rounding.
    """
    check_array("x", x, min_ndim=1)
    n = x.shape[-1]
    if not _is_pow2(n):
        raise ValueError(f"fwht: the last axis must be a power of two, got {n}")
    lead = x.shape[:-1]
    y = x.astype(mx.float32) if x.dtype != mx.float32 else x
    h = 1
    while h < n:
        y = y.reshape(*lead, n // (2 * h), 2, h)
        a, b = y[..., 0, :], y[..., 1, :]
        y = mx.stack([a + b, a - b], axis=-2)
        h *= 2
    y = y.reshape(*lead, n) * (1.0 / math.sqrt(n))
    return y.astype(x.dtype)


def hadamard(x: mx.array, block: int | None = None) -> mx.array:
    """Orthonormal (block-)Hadamard transform along the last axis.

    Uses MLX's fused ``mx.hadamard_transform`` and falls back to :func:`fwht` when
    ``VELOX_KERNELS=0``. ``block`` defaults to the whole axis, which must then be a power of two.

    Shapes:
        x: ``(..., d)``; returns ``(..., d)`` in ``x.dtype``.
    """
    from ..kernels import kernels_enabled

    d = x.shape[-1]
    block = d if block is None else block
    if not _is_pow2(block) or d % block:
        raise ValueError(f"hadamard: block must be a power of two dividing {d}, got {block}")
    y = x.reshape(*x.shape[:-1], d // block, block) if block != d else x
    if kernels_enabled():
        y = mx.hadamard_transform(y.astype(mx.float32)).astype(x.dtype)
    else:
        y = fwht(y)
    return y.reshape(x.shape)


class RandomizedHadamard:
    """Seeded rotation ``R x = H_blk(P(s * x))``, orthogonal, with an exact inverse.

    Args:
        dim: vector length (head dim). Powers of two use one full Hadamard; other sizes use
            blocks of :func:`block_size` after a seeded permutation.
        seed: seed of the signs and the permutation (numpy PCG64, the same on every platform).

    Shapes:
        ``forward(x)`` and ``inverse(y)`` take ``(..., dim)`` and return the same shape.
    """

    def __init__(self, dim: int, seed: int = 0):
        check_int("dim", dim, minimum=2)
        check_int("seed", seed, minimum=0)
        self.dim, self.seed = dim, seed
        self.block = dim if _is_pow2(dim) else block_size(dim)
        if self.block < 2:
            raise ValueError(
                f"RandomizedHadamard: dim {dim} is odd; use a random orthogonal rotation"
            )
        rng = np.random.default_rng(seed)
        self.signs = mx.array(rng.choice([-1.0, 1.0], size=dim).astype(np.float32))
        if self.block != dim:
            perm = rng.permutation(dim)
            self.perm = mx.array(perm.astype(np.int32))
            self.inv_perm = mx.array(np.argsort(perm).astype(np.int32))
        else:
            self.perm = self.inv_perm = None

    def forward(self, x: mx.array) -> mx.array:
        # x * signs promotes x to float32 in the multiply itself (exact: a sign flip of a
        # float16 or bfloat16 value), one launch instead of a cast and a multiply
        y = x * self.signs
        if self.perm is not None:
            y = mx.take(y, self.perm, axis=-1)
        return hadamard(y, self.block)

    def inverse(self, y: mx.array) -> mx.array:
        x = hadamard(y.astype(mx.float32), self.block)
        if self.inv_perm is not None:
            x = mx.take(x, self.inv_perm, axis=-1)
        return x * self.signs

    def matrix(self) -> mx.array:
        """The dense ``(dim, dim)`` matrix ``R`` with ``forward(x) == x @ R.T``."""
        return self.forward(mx.eye(self.dim)).T


class HadamardRotation:
    """An orthonormal Hadamard rotation of ``dim`` channels, ``forward(x) = R x``: the
    normalized Sylvester matrix (``R = R^T = R^-1``; block-diagonal with blocks of
    :func:`block_size` where ``dim`` is not a power of two), or with a ``seed``
    :class:`RandomizedHadamard` (seeded signs, and a seeded permutation across blocks).

    Args:
        dim: channels (the head dim); must be even.
        seed: None for the Sylvester matrix, or the seed of random signs.

    Shapes:
        ``forward(x)`` and ``inverse(y)`` take ``(..., dim)`` and return float32 ``(..., dim)``.
    """

    def __init__(self, dim: int, seed: int | None = None):
        check_int("dim", dim, minimum=2)
        self.dim, self.seed = dim, seed
        self.block = block_size(dim)
        if self.block < 2:
            raise ValueError(f"head dim {dim} is odd: no Hadamard block divides it")
        self._random = None if seed is None else RandomizedHadamard(dim, seed)

    def forward(self, x: mx.array) -> mx.array:
        if self._random is not None:
            return self._random.forward(x).astype(mx.float32)
        return hadamard(x.astype(mx.float32), self.block)

    def inverse(self, y: mx.array) -> mx.array:
        if self._random is not None:
            return self._random.inverse(y).astype(mx.float32)
        return hadamard(y.astype(mx.float32), self.block)  # symmetric and orthonormal

    def arrays(self) -> dict[str, mx.array]:
        """A seeded rotation's resident arrays (``rot.signs``, ``rot.perm``); none for the
        Sylvester matrix (the transform computes it)."""
        r = self._random
        if r is None:
            return {}
        out = {"rot.signs": r.signs}
        if r.perm is not None:
            out["rot.perm"] = r.perm
        return out
