"""GPU encode kernels of TurboQuant: the Lloyd-Max search and packing (the codebook encode
kernel, bit for bit the reference) and TurboQuant_prod's residual sign sketch.

* :func:`codebook_encode`: :meth:`velox_core.ops.Codebook.encode` followed by
  :func:`velox_core.ops.pack` (``metal/encode_codebook.metal``). The kernel compares against
  the same thresholds as the reference, so its codes are identical everywhere.
* :func:`residual_sketch_encode`: the sign sketch and norm of a Lloyd-Max code's residual
  ``y - levels[code(y)]`` (codebook keys with a residual sketch;
  ``metal/encode_residual_sketch.metal``). Its residuals are the reference's bit for bit; it
  sums ``S r`` in channel order where the reference's matmul sums in its own, so a sign bit
  can differ only where ``|S r|`` is within float32 rounding of 0, a norm by a rounding of
  its dtype.

Both kernel sources ship in this package's ``metal/`` folder. :func:`encode_codes` and
:func:`encode_prod` are called by :class:`velox_turboquant.quantizer.SphereQuantizer` (passed
as ``quant``; this module does not import it, so the two import in one direction only); each
returns None where kernels do not run, and the quantizer codes on the reference path.
"""

from __future__ import annotations

import math

import mlx.core as mx

from velox_core.kernels import use_kernels
from velox_core.kernels.build import KernelSpec
from velox_core.kernels.encode import FLOATS, THREADS, sketch_encode

__all__ = [
    "CODEBOOK_ENCODE",
    "RESIDUAL_SKETCH_ENCODE",
    "codebook_encode",
    "encode_codes",
    "encode_prod",
    "residual_sketch_encode",
]

CODEBOOK_ENCODE = KernelSpec(
    name="velox_encode_codebook",
    source="encode_codebook.metal",
    package="velox_turboquant",
    inputs=("y", "bounds"),
    outputs=("codes",),
)
RESIDUAL_SKETCH_ENCODE = KernelSpec(
    name="velox_encode_residual_sketch",
    source="encode_residual_sketch.metal",
    package="velox_turboquant",
    inputs=("y", "s", "bounds", "levels"),
    outputs=("sign", "rnorm"),
)


def codebook_encode(y: mx.array, bounds: mx.array, bits: int) -> mx.array | None:
    """Packed codebook codes of ``y`` along its last axis, or None if the kernel does not apply.

    Shapes:
        y ``(..., D)`` (cast to float32); bounds ``(2**bits - 1,)`` ascending thresholds;
        returns ``(..., ceil(D*bits/32))`` uint32.
    """
    *lead, dim = y.shape
    if not 1 <= bits <= 8 or bounds.shape != ((1 << bits) - 1,):
        return None
    rows = math.prod(lead)
    if rows == 0:
        return None
    words = -(-dim * bits // 32)
    (codes,) = CODEBOOK_ENCODE.kernel()(
        inputs=[y.astype(mx.float32).reshape(rows, dim), bounds.astype(mx.float32)],
        template=[("BITS", bits), ("HD", dim)],
        grid=(rows, 1, 1),
        threadgroup=(min(THREADS, rows), 1, 1),
        output_shapes=[(*lead, words)],
        output_dtypes=[mx.uint32],
    )
    return codes


def residual_sketch_encode(
    y: mx.array, s: mx.array, bounds: mx.array, levels: mx.array, bits: int, norm_dtype: mx.Dtype
) -> tuple[mx.array, mx.array] | None:
    """The packed sign sketch and the norm of the Lloyd-Max residual ``r = y - levels[c]``
    (``c`` the codes :func:`codebook_encode` packs) in one launch, or None if the kernel does
    not apply.

    Shapes:
        y ``(..., D)`` (cast to float32); s ``(m, D)`` the projection (any float dtype);
        bounds ``(2**bits - 1,)`` ascending thresholds, levels ``(2**bits,)``. Returns sign
        ``(..., ceil(m / 32))`` uint32 (``pack(sign_sketch(r, s), 1)``) and rnorm ``(...)``
        ``||r||`` in ``norm_dtype``.
    """
    if y.ndim < 2 or s.ndim != 2 or s.dtype not in FLOATS or not 1 <= bits <= 8:
        return None
    *lead, dim = y.shape
    m = s.shape[0]
    n = 1 << bits
    if s.shape[1] != dim or m < 1 or bounds.shape != (n - 1,) or levels.shape != (n,):
        return None
    if norm_dtype not in FLOATS:
        return None
    rows = math.prod(lead)
    words = -(-m // 32)
    if rows == 0 or rows * words >= 1 << 31:  # (the grid's x is a 32-bit int)
        return None
    sign, rnorm = RESIDUAL_SKETCH_ENCODE.kernel()(
        inputs=[
            y.astype(mx.float32).reshape(rows, dim),
            s,
            bounds.astype(mx.float32),
            levels.astype(mx.float32),
        ],
        template=[("D", dim), ("M", m), ("BITS", bits), ("NT", norm_dtype)],
        grid=(rows * words, 1, 1),
        threadgroup=(THREADS, 1, 1),
        output_shapes=[(*lead, words), tuple(lead)],
        output_dtypes=[mx.uint32, norm_dtype],
    )
    return sign, rnorm


def encode_codes(quant, y: mx.array) -> mx.array | None:
    """Packed Lloyd-Max codes of rotated unit vectors ``y`` (GPU kernel), or None, for a
    :class:`~velox_turboquant.quantizer.SphereQuantizer` ``quant``.

    Shapes:
        y ``(..., T, dim)`` float32; returns ``(..., T, ceil(dim * bits / 32))`` uint32.
    """
    if not use_kernels() or quant.bounds is None or quant.sketch is not None:
        return None  # (no thresholds: no codebook, or rvq's two-stage search)
    return codebook_encode(y, quant.bounds, quant.mse_bits)


def encode_prod(quant, y: mx.array, norm_dtype: mx.Dtype) -> dict[str, mx.array] | None:
    """TurboQuant_prod's record fields but the norm (``codes``, ``signs``, ``rnorm``) of
    rotated unit vectors ``y`` (GPU kernels), or None.

    The codes through the codebook kernel (bit for bit the reference's), the residual's sign
    sketch and norm through the residual-sketch kernel (the residual the reference's bit for
    bit; a sign differs only where ``S r`` is within rounding of 0). 1-bit keys (QJL alone:
    no codes, the residual is ``y``) take the QJL keys' sketch kernel without outliers.

    Shapes:
        y ``(..., T, dim)`` float32; returns the fields as ``SphereQuantizer.encode`` does.
    """
    if not use_kernels() or quant.sketch is None:
        return None
    if quant.codebook is None:
        res = sketch_encode(y, quant.sketch, quant.sketch.shape[0])
        if res is None:
            return None
        return {"signs": res[0], "rnorm": res[1].astype(norm_dtype)}
    codes = codebook_encode(y, quant.bounds, quant.mse_bits)
    if codes is None:
        return None
    res = residual_sketch_encode(
        y, quant.sketch, quant.bounds, quant.levels, quant.mse_bits, norm_dtype
    )
    if res is None:
        return None
    return {"codes": codes, "signs": res[0], "rnorm": res[1]}
