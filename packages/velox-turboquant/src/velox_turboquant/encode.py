"""GPU encode kernels of TurboQuant: the Lloyd-Max search and packing (velox-core's codebook
encode kernel, bit for bit the reference) and TurboQuant_prod's residual sign sketch.

Called by :class:`velox_turboquant.quantizer.SphereQuantizer` (passed as ``quant``; this
module does not import it, so the two import in one direction only); each function returns
None where kernels do not run, and the quantizer codes on the reference path.
"""

from __future__ import annotations

import mlx.core as mx

from velox_core.kernels import use_kernels
from velox_core.kernels.encode import codebook_encode, residual_sketch_encode, sketch_encode

__all__ = ["encode_codes", "encode_prod"]


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
