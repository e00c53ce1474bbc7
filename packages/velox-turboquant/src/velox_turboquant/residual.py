"""TurboQuant RVQ: two-stage residual scalar codes, stored as one ``2b``-bit codebook code.

The variant of VeloxQuant-MLX (the library velox was modelled on; there is no paper): each
coordinate of the rotated unit vector ``y`` is coded in two stages of ``b`` bits.

1. ``i1``: the nearest level of the ``b``-bit Lloyd-Max codebook of the sphere law (what
   TurboQuant_mse does), ``y1 = c1[i1]``;
2. ``i2``: the nearest level of the ``b``-bit Lloyd-Max codebook of a zero-mean Laplacian to
   the residual ``r = y - y1``, ``y2 = c2[i2]``.

The reconstruction is ``y1 + y2``. The Laplacian's scale follows the library's rule:
``sigma_q = sqrt(1/d) * (sqrt(3 pi) / 2) * 4^-b``, scale ``sigma_q / sqrt(2)``
(:func:`residual_scale`).

The pair is stored as the one ``2b``-bit code ``i = i1 * 2^b + i2``, whose level is
``c1[i1] + c2[i2]``: a ``4^b``-entry table (:attr:`ResidualCodebook.centroids`), i.e. a
``2b``-bit scalar codebook. Decoding, scores and the value mix therefore read RVQ codes exactly
as TurboQuant_mse's (levels by table lookup), and so do velox-core's codebook kernels. Only the
encoding differs: it is the two nearest-level searches above (greedy), not the nearest entry
of the table, so there are no decision thresholds for the fused encode kernel; RVQ codes are
encoded by MLX ops.

A ``2b``-bit Lloyd-Max codebook of the same law has the least MSE of any ``4^b``-level scalar
quantizer of a coordinate; the RVQ table is one such quantizer, so plain TurboQuant_mse at
``2b`` bits is at least as accurate (a test measures both, docs/turboquant.md shows them).
"""

from __future__ import annotations

import math
from functools import cache

import mlx.core as mx
import numpy as np

from velox_core.ops import Codebook, lloyd_max
from velox_core.validation import check_bits, check_int

__all__ = [
    "MAX_STAGE_BITS",
    "ResidualCodebook",
    "lloyd_max_laplace",
    "lloyd_max_sphere",
    "residual_scale",
]

MAX_STAGE_BITS = 4  # two stages of at most 4 bits: codes of at most 8 bits
_GRID = 1 << 18
_SUPPORT = 40.0  # the grid covers +-40 scales: the Laplacian's mass beyond is e^-40


@cache
def lloyd_max_sphere(bits: int, dim: int) -> Codebook:
    """Lloyd-Max codebook for one coordinate of a uniform unit vector in ``R^dim`` (what a
    randomly rotated, normalized key looks like): ``f(x) ∝ (1 - x^2)^((dim-3)/2)`` on
    ``[-1, 1]``, which tends to ``N(0, 1/dim)`` as ``dim`` grows (arXiv 2504.19874, Lemma 1).
    TurboQuant_mse's codebook, and the first stage of RVQ.

    ``dim * mse`` is the expected squared error ``E||x - x_hat||^2`` of a unit vector whose
    coordinates are all quantized with this codebook after a random rotation.
    """
    check_bits("bits", bits)
    check_int("dim", dim, minimum=3)
    grid = np.linspace(-1.0, 1.0, _GRID + 1)[1:-1]
    logpdf = 0.5 * (dim - 3) * np.log1p(-grid * grid)
    return lloyd_max(grid, np.exp(logpdf - logpdf.max()), bits, iters=2000, symmetric=True)


def residual_scale(stage_bits: int, dim: int) -> float:
    """The Laplacian scale of the second stage: ``sigma_q / sqrt(2)`` with
    ``sigma_q = sqrt(1/dim) * (sqrt(3 pi) / 2) * 4^-stage_bits``, VeloxQuant-MLX's estimate of
    the first stage's error (a Laplacian of scale ``s`` has standard deviation ``s sqrt(2)``)."""
    sigma_q = math.sqrt(1.0 / dim) * (math.sqrt(3.0 * math.pi) / 2.0) * 4.0**-stage_bits
    return sigma_q / math.sqrt(2.0)


@cache
def lloyd_max_laplace(bits: int, scale: float) -> Codebook:
    """Lloyd-Max codebook of the zero-mean Laplacian ``f(x) = exp(-|x| / scale) / (2 scale)``.

    ``mse`` is the per-coordinate distortion under that law.
    """
    if isinstance(scale, bool) or not isinstance(scale, (int, float)):
        raise TypeError(f"lloyd_max_laplace: scale must be a number, got {type(scale).__name__}")
    scale = float(scale)
    if not (math.isfinite(scale) and scale > 0):
        raise ValueError(f"lloyd_max_laplace: scale must be a positive float, got {scale!r}")
    grid = np.linspace(-_SUPPORT * scale, _SUPPORT * scale, _GRID + 1)
    pdf = np.exp(-np.abs(grid) / scale)
    return lloyd_max(grid, pdf, bits, iters=2000, symmetric=True)


class ResidualCodebook:
    """The two stages of RVQ at ``stage_bits`` bits each for coordinates of a unit vector of
    ``R^dim``, as one ``2 * stage_bits``-bit codebook.

    Args:
        stage_bits: bits of each stage, 1 to :data:`MAX_STAGE_BITS`.
        dim: the vector length (at least 3).
        scale: the second stage's Laplacian scale; None (the codec's choice): the library's
            rule, :func:`residual_scale`.

    Attributes:
        bits: the code width, ``2 * stage_bits``.
        first: the sphere law's Lloyd-Max codebook (stage 1).
        second: the Laplacian's Lloyd-Max codebook (stage 2), of scale :attr:`scale`.
        centroids: ``(4**stage_bits,)`` float32, level of code ``i1 * 2**stage_bits + i2``
            is ``first[i1] + second[i2]``.
    """

    def __init__(self, stage_bits: int, dim: int, scale: float | None = None):
        self.stage_bits = check_int("stage_bits", stage_bits, minimum=1, maximum=MAX_STAGE_BITS)
        self.dim = check_int("dim", dim, minimum=3)
        self.bits = 2 * stage_bits
        self.first = lloyd_max_sphere(stage_bits, dim)
        self.scale = residual_scale(stage_bits, dim) if scale is None else scale
        self.second = lloyd_max_laplace(stage_bits, self.scale)
        table = self.first.centroids[:, None] + self.second.centroids[None, :]
        self.centroids = table.reshape(-1).astype(np.float32)

    def levels(self) -> mx.array:
        return mx.array(self.centroids)

    def encode(self, y: mx.array) -> mx.array:
        """The two-stage codes ``i1 * 2^b + i2``. Shapes: any; returns uint8 of the same shape."""
        y = y.astype(mx.float32)
        i1 = self.first.encode(y)
        i2 = self.second.encode(y - self.first.decode(i1))
        return (i1.astype(mx.uint32) * (1 << self.stage_bits) + i2.astype(mx.uint32)).astype(
            mx.uint8
        )

    def decode(self, codes: mx.array) -> mx.array:
        """Shapes: codes of any shape; returns float32 levels of the same shape."""
        return mx.take(self.levels(), codes.astype(mx.int32))

    def stages(self, codes: mx.array) -> tuple[mx.array, mx.array]:
        """``(i1, i2)`` of codes (uint8 each)."""
        c = codes.astype(mx.uint32)
        return (c >> self.stage_bits).astype(mx.uint8), (c & ((1 << self.stage_bits) - 1)).astype(
            mx.uint8
        )
