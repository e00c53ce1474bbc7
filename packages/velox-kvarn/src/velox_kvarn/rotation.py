"""The Hadamard rotation KVarN applies to the channels of keys and values.

The authors rotate by the normalized Sylvester Hadamard matrix ``H`` (``H = H^T = H^-1``),
with no random signs. A head dim that is not a power of two has no Sylvester matrix; there
the rotation is block-diagonal, one Sylvester block of the largest power of two dividing the
head dim (16 at head dims 80 and 112, 32 at 96). With a ``seed`` the rotation is velox-core's
randomized Hadamard instead (seeded signs, and a seeded permutation across blocks at those
head dims): an option, not the paper's.
"""

from __future__ import annotations

import mlx.core as mx

from velox_core.ops import RandomizedHadamard, block_size, hadamard
from velox_core.validation import check_int

__all__ = ["HadamardRotation"]


class HadamardRotation:
    """An orthonormal Hadamard rotation of ``dim`` channels, ``forward(x) = R x``.

    Args:
        dim: channels (the head dim); must be even.
        seed: None for the Sylvester matrix (the paper's), or the seed of random signs.

    Shapes:
        ``forward(x)`` and ``inverse(y)`` take ``(..., dim)`` and return float32 ``(..., dim)``.
    """

    def __init__(self, dim: int, seed: int | None = None):
        check_int("dim", dim, minimum=2)
        self.dim, self.seed = dim, seed
        self.block = dim if dim & (dim - 1) == 0 else block_size(dim)
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
        """The resident arrays of a seeded rotation (its signs and permutation); the
        Sylvester rotation has none (the transform computes it)."""
        r = self._random
        if r is None:
            return {}
        out = {"rot.signs": r.signs}
        if r.perm is not None:
            out["rot.perm"] = r.perm
        return out
