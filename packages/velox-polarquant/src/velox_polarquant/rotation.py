"""The random preconditioning of PolarQuant: a seeded rotation of the head dim.

The paper multiplies every key and value by one random rotation ``S`` (shared by keys and
values, every layer and head), which makes the direction of any vector a uniform point of
the sphere, so that its polar angles follow the laws the codebooks are built for. Two kinds:

- ``"haar"``: the paper's dense random rotation matrix, Haar-distributed
  (:func:`velox_core.ops.random_orthogonal`): ``d^2`` float32 resident numbers a codec;
- ``"hadamard"``: a randomized Hadamard rotation, ``H (s * x)`` with seeded signs ``s``
  (:class:`velox_core.ops.RandomizedHadamard`; head dims that are not powers of two take
  Hadamard blocks after a seeded permutation): ``d`` signs resident, ``O(d log d)`` a vector;
- None: no preconditioning (the paper's "PolarQuant" rows, against "PolarQuant-R"): the
  angles then follow no known law, so only codebooks fitted online apply.
"""

from __future__ import annotations

import mlx.core as mx

from velox_core.ops import RandomizedHadamard, random_orthogonal

__all__ = ["ROTATIONS", "Rotation"]

ROTATIONS = ("hadamard", "haar", None)


class Rotation:
    """A seeded orthogonal map ``forward(x) = S x`` of ``R^dim``.

    Args:
        dim: the head dim (even).
        kind: ``"hadamard"``, ``"haar"`` or None (the identity).
        seed: the seed of the signs (and permutation) or of the matrix.

    Shapes:
        ``forward(x)`` and ``inverse(y)`` take ``(..., dim)`` and return float32 ``(..., dim)``.
    """

    def __init__(self, dim: int, kind: str | None, seed: int):
        self.dim, self.kind, self.seed = dim, kind, seed
        self.hadamard = RandomizedHadamard(dim, seed) if kind == "hadamard" else None
        self.matrix = random_orthogonal(dim, seed) if kind == "haar" else None

    def forward(self, x: mx.array) -> mx.array:
        if self.hadamard is not None:
            return self.hadamard.forward(x).astype(mx.float32)
        if self.matrix is None:
            return x.astype(mx.float32)
        return x.astype(mx.float32) @ self.matrix.T

    def inverse(self, y: mx.array) -> mx.array:
        if self.hadamard is not None:
            return self.hadamard.inverse(y).astype(mx.float32)
        if self.matrix is None:
            return y.astype(mx.float32)
        return y.astype(mx.float32) @ self.matrix

    def arrays(self) -> dict[str, mx.array]:
        """The resident arrays: the signs (and permutation), the matrix, or none."""
        h = self.hadamard
        if h is None:
            return {} if self.matrix is None else {"rot.matrix": self.matrix}
        out = {"rot.signs": h.signs}
        if h.perm is not None:
            out["rot.perm"] = h.perm
        return out
