"""TurboQuant on one subspace: a seeded rotation, Lloyd-Max codes, and the QJL residual sketch.

TurboQuant (arXiv 2504.19874) stores a vector ``x`` in ``R^d`` as its norm and the codes of
``y = R x / ||x||``, a point that a random rotation ``R`` makes look like a uniform point of the
unit sphere, whose coordinates all follow ``f(t) ∝ (1 - t^2)^((d-3)/2)`` (Lemma 1). Each
coordinate is quantized alone with the Lloyd-Max codebook of that law (``TurboQuant_mse``,
Algorithm 1). ``TurboQuant_prod`` (Algorithm 2) spends ``b - 1`` bits on those codes and one
bit per coordinate on QJL, ``sign(S r)`` of the residual ``r = y - y_hat`` with ``S`` an
i.i.d. Gaussian ``(d, d)`` matrix, plus ``||r||``; its inner-product estimate
``<q, y_hat> + sqrt(pi/2) / d * ||r|| * <S q, sign(S r)>`` is unbiased. The ``rvq`` variant
(VeloxQuant-MLX's, no paper: :mod:`velox_turboquant.residual`) codes each coordinate in two
stages of ``bits / 2`` and stores the pair as one ``bits``-bit code of a ``2**bits``-level
table, read like TurboQuant_mse's codes.

Everything here works in the rotated domain: scores come from the rotated query against the
codebook levels, and :meth:`SphereQuantizer.mix_rotated` returns weighted sums of levels,
which the caller rotates back once. On a GPU with kernels enabled, TurboQuant_mse codes are
searched and packed by one kernel (:mod:`velox_turboquant.encode`, bit for bit the
reference); TurboQuant_prod's codes by the same kernel and its residual's sign sketch and
norm by a second one. RVQ codes (two searches) are encoded by MLX ops on every device.
"""

from __future__ import annotations

import math

import mlx.core as mx
import numpy as np

from velox_core.kernels.layout import levels_symmetric
from velox_core.ops import (
    BYTE_BITS,
    RandomizedHadamard,
    block_size,
    byte_table,
    jl_matrix,
    lookup,
    pack,
    random_orthogonal,
    sign_sketch,
    unpack,
)

from .encode import encode_codes, encode_prod
from .residual import ResidualCodebook, lloyd_max_sphere

__all__ = ["MIN_HADAMARD_BLOCK", "Rotation", "SphereQuantizer", "derive_seed"]


MIN_HADAMARD_BLOCK = 16  # below this block a block-Hadamard mixes too little: use Haar


def derive_seed(seed: int, *path: int) -> int:
    """An independent 31-bit seed for the stream named by ``path`` under ``seed``."""
    return int(np.random.SeedSequence([seed, *path]).generate_state(1)[0] >> 1)


def _pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


class Rotation:
    """A seeded orthogonal map of ``R^dim``.

    A randomized Hadamard rotation (:class:`velox_core.ops.RandomizedHadamard`, block-diagonal
    after a seeded permutation for dims such as 80, 96, 112) when its Hadamard block has at
    least :data:`MIN_HADAMARD_BLOCK` entries (or covers the whole dim); otherwise a seeded Haar
    orthogonal matrix, the paper's own ``Π``.

    Shapes:
        ``forward`` and ``inverse`` take ``(..., dim)`` float32 and return the same shape.
    """

    def __init__(self, dim: int, seed: int):
        self.dim = dim
        blk = block_size(dim)
        if _pow2(dim) or blk >= MIN_HADAMARD_BLOCK:
            self.hadamard: RandomizedHadamard | None = RandomizedHadamard(dim, seed)
            self.matrix = None
        else:
            self.hadamard, self.matrix = None, random_orthogonal(dim, seed)

    def forward(self, x: mx.array) -> mx.array:
        if self.hadamard is not None:
            return self.hadamard.forward(x)
        return x @ self.matrix.T

    def inverse(self, y: mx.array) -> mx.array:
        if self.hadamard is not None:
            return self.hadamard.inverse(y)
        return y @ self.matrix

    def arrays(self) -> dict[str, mx.array]:
        if self.hadamard is None:
            return {"matrix": self.matrix}
        h = self.hadamard
        out = {"signs": h.signs}
        if h.perm is not None:
            out.update(perm=h.perm, inv_perm=h.inv_perm)
        return out


class SphereQuantizer:
    """``TurboQuant_mse``, ``TurboQuant_prod`` or TurboQuant RVQ of vectors of one dimension.

    Args:
        dim: vector length (at least 3).
        bits: bits per coordinate: all Lloyd-Max codes (``"mse"``), ``bits - 1`` of codes
            plus one sketch bit (``"prod"``; ``bits = 1`` is QJL alone), or two residual
            stages of ``bits / 2`` (``"rvq"``, even ``bits`` from 2 to 8).
        variant: ``"mse"``, ``"prod"`` or ``"rvq"``.
        seed: seed of the rotation and of the sketch matrix (independent streams).

    Record fields (arrays with tokens on axis -2 of codes and -1 of norms): ``codes``
    (packed uint32, ``mse_bits`` each: ``rvq``'s both stages in one code), ``norm``
    (``||x||``), and for ``prod`` ``signs`` (packed 1-bit) and
    ``rnorm`` (``||r||`` of the unit vector's residual).
    """

    def __init__(self, dim: int, bits: int, variant: str, seed: int):
        self.dim, self.bits, self.variant, self.seed = dim, bits, variant, seed
        self.mse_bits = bits - 1 if variant == "prod" else bits
        self.rotation = Rotation(dim, derive_seed(seed, 0))
        if variant == "rvq":
            if bits % 2:
                raise ValueError(f"rvq codes two stages of bits/2: bits must be even, got {bits}")
            self.codebook = ResidualCodebook(bits // 2, dim)
        else:
            self.codebook = lloyd_max_sphere(self.mse_bits, dim) if self.mse_bits else None
        self.levels = None if self.codebook is None else self.codebook.levels()
        # the fused encode kernel's thresholds: one nearest-level search (not rvq's two)
        self.bounds = None
        if self.codebook is not None and variant != "rvq":
            self.bounds = mx.array(self.codebook.boundaries)
        # the levels' symmetry in fp16, which the tensor-core kernel's lookups use (checked
        # once here, on the host values: CodebookCodes.symmetric)
        self.levels_symmetric = self.codebook is not None and levels_symmetric(
            self.codebook.centroids
        )
        self.sketch = jl_matrix(dim, dim, derive_seed(seed, 1)) if variant == "prod" else None
        self.qjl = math.sqrt(math.pi / 2) / dim  # the QJL constant for m = dim sketch rows
        self._byte_luts: dict[mx.Dtype, mx.array] = {}  # per dtype: the levels' byte_table

    def arrays(self) -> dict[str, mx.array]:
        """The resident arrays: rotation, codebook, sketch matrix."""
        out = {f"rot.{k}": a for k, a in self.rotation.arrays().items()}
        if self.codebook is not None:
            out["levels"] = self.levels
        if self.bounds is not None:
            out["bounds"] = self.bounds
        if self.sketch is not None:
            out["sketch"] = self.sketch
        return out

    # -- coding ------------------------------------------------------------------------------
    def encode(self, x: mx.array, norm_dtype: mx.Dtype) -> dict[str, mx.array]:
        """Shapes: x ``(..., T, dim)`` float32; returns the record fields (see the class)."""
        norm = mx.sqrt(mx.sum(x * x, axis=-1))
        y = self.rotation.forward(x / mx.maximum(norm, 1e-30)[..., None])
        out = {"norm": norm.astype(norm_dtype)}
        fused = encode_codes(self, y)  # GPU kernel (mse), or None
        if fused is not None:
            out["codes"] = fused
            return out
        fields = encode_prod(self, y, norm_dtype)  # GPU kernels (prod), or None
        if fields is not None:
            out.update(fields)
            return out
        y_hat = mx.zeros_like(y)
        if self.codebook is not None:
            codes = self.codebook.encode(y)
            out["codes"] = pack(codes, self.mse_bits)
            y_hat = self.codebook.decode(codes)
        if self.sketch is not None:
            r = y - y_hat
            out["signs"] = pack(sign_sketch(r, self.sketch), 1)
            out["rnorm"] = mx.sqrt(mx.sum(r * r, axis=-1)).astype(norm_dtype)
        return out

    def _levels(self, data: dict[str, mx.array], dtype: mx.Dtype = mx.float32) -> mx.array | None:
        """The codes' levels ``(..., T, dim)`` in ``dtype`` (None without a codebook)."""
        if self.codebook is None:
            return None
        if self.mse_bits not in BYTE_BITS:
            codes = unpack(data["codes"], self.mse_bits, self.dim).astype(mx.int32)
            return mx.take(self.levels if dtype == mx.float32 else self.levels.astype(dtype), codes)
        if dtype not in self._byte_luts:
            self._byte_luts[dtype] = byte_table(self.levels, self.mse_bits).astype(dtype)
        return lookup(data["codes"], self.mse_bits, self.dim, self._byte_luts[dtype])

    def _signs(self, data: dict[str, mx.array]) -> mx.array:
        return unpack(data["signs"], 1, self.dim).astype(mx.float32) * 2 - 1

    def decode_rotated(self, data: dict[str, mx.array]) -> mx.array:
        """``||x|| * (y_hat + sqrt(pi/2)/d * ||r|| * S^T sign(S r))`` in the rotated domain.

        Shapes: returns float32 ``(..., T, dim)``.
        """
        norm = data["norm"].astype(mx.float32)[..., None]
        y = self._levels(data)
        if self.sketch is not None:
            g = data["rnorm"].astype(mx.float32)[..., None] * self.qjl
            z = g * (self._signs(data) @ self.sketch)
            y = z if y is None else y + z
        return y * norm

    def decode_rotated_as(self, data: dict[str, mx.array], dtype: mx.Dtype) -> mx.array:
        """:meth:`decode_rotated` in ``dtype``; ``mse`` codes look their levels up in ``dtype``
        and scale them by the norm there, without a float32 copy of the block.

        Shapes: returns ``(..., T, dim)`` in ``dtype``.
        """
        if self.sketch is not None:
            return self.decode_rotated(data).astype(dtype)
        return self._levels(data, dtype) * data["norm"].astype(dtype)[..., None]

    def decode(self, data: dict[str, mx.array]) -> mx.array:
        """Shapes: returns float32 ``(..., T, dim)`` in the original coordinates."""
        return self.rotation.inverse(self.decode_rotated(data))

    # -- compressed-domain attention ------------------------------------------------------------
    def rotate_query(self, q: mx.array) -> tuple[mx.array, mx.array | None]:
        """``(R q, S R q)``, the query as the codes see it (the second only for ``prod``).

        Shapes: q ``(..., M, dim)`` float32; returns ``(..., M, dim)`` twice (or None).
        """
        q_rot = self.rotation.forward(q)
        return q_rot, None if self.sketch is None else q_rot @ self.sketch.T

    def scores(
        self, q_rot: mx.array, q_sketch: mx.array | None, data: dict[str, mx.array]
    ) -> mx.array:
        """``<q, x_hat>`` from the codes: levels against ``R q``, sketch against ``S R q``.

        Shapes: q_rot ``(..., M, dim)``; returns float32 ``(..., M, T)``.
        """
        s = None
        lv = self._levels(data)
        if lv is not None:
            s = q_rot @ mx.swapaxes(lv, -1, -2)
        if self.sketch is not None:
            qjl = (q_sketch @ mx.swapaxes(self._signs(data), -1, -2)) * (
                data["rnorm"].astype(mx.float32)[..., None, :] * self.qjl
            )
            s = qjl if s is None else s + qjl
        return s * data["norm"].astype(mx.float32)[..., None, :]

    def mix_rotated(self, w: mx.array, data: dict[str, mx.array]) -> mx.array:
        """``sum_t w_t R x_hat_t`` from the codes (rotate back once with ``rotation.inverse``).

        Shapes: w ``(..., M, T)`` float32; returns ``(..., M, dim)``.
        """
        wn = w * data["norm"].astype(mx.float32)[..., None, :]
        out = None
        lv = self._levels(data)
        if lv is not None:
            out = wn @ lv
        if self.sketch is not None:
            wg = wn * (data["rnorm"].astype(mx.float32)[..., None, :] * self.qjl)
            z = (wg @ self._signs(data)) @ self.sketch
            out = z if out is None else out + z
        return out
