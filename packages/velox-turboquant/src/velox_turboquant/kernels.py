"""GPU kernel paths of TurboQuant_mse: fused decode attention and fused encode.

Both reuse velox-core's kernels (:mod:`velox_core.kernels.decode`,
:mod:`velox_core.kernels.encode`) with *codebook* codes: a TurboQuant_mse record is, in the
rotated domain, ``x = norm * levels[code]`` per coordinate, with one norm per token.

* Decode attention: the query is rotated once (``R q``, an MLX op); the kernel scores it
  against the key levels times the key norms, and mixes the value levels times the value
  norms with the softmax weights, all in the rotated domain, in one pass over the codes
  split along the context; the ``(M, D)`` output is rotated back once (``R^T o``, the
  existing MLX op). ``m`` and ``l`` need no rotation.
* Encode: the norm and the rotation stay MLX ops; the kernel does the Lloyd-Max search
  (the same threshold comparisons as :meth:`velox_core.ops.Codebook.encode`) and packs the
  codes, bit for bit the reference.

Fractional widths (outlier channel split) and the ``prod`` variant (QJL sketch) fall back to
the reference (the functions return None).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import mlx.core as mx

from velox_core import Packed
from velox_core.kernels import use_kernels
from velox_core.kernels.decode import CODEBOOK, Codes, decode_attention
from velox_core.kernels.encode import codebook_encode

if TYPE_CHECKING:
    from .codec import TurboQuant
    from .quantizer import SphereQuantizer

__all__ = ["attend_partial", "encode_codes"]


def _mse_part(codec) -> SphereQuantizer | None:
    """The single TurboQuant_mse quantizer of an integer-width mse codec, else None."""
    from .codec import TurboQuant

    if not isinstance(codec, TurboQuant) or codec.fractional or codec.variant != "mse":
        return None
    if codec.dim is None or len(codec.parts) != 1:
        return None
    return codec.parts[0][1]


def attend_partial(
    key_codec: TurboQuant, q: mx.array, keys: Packed, value_codec, values: Packed
) -> tuple[mx.array, mx.array, mx.array] | None:
    """Partial ``(o, m, l)`` of one segment from the codes (GPU kernel), or None.

    Shapes:
        q ``(B, H, M, D)`` float32, scale applied; returns ``(B, H, M, D)``,
        ``(B, H, M, 1)``, ``(B, H, M, 1)`` float32.
    """
    if not use_kernels():
        return None
    kq, vq = _mse_part(key_codec), _mse_part(value_codec)
    if kq is None or vq is None or kq.dim != vq.dim or kq.dim != q.shape[-1]:
        return None
    k, v = keys.data, values.data
    out = decode_attention(
        kq.rotation.forward(q),
        Codes(CODEBOOK, kq.mse_bits, kq.dim, k["codes"], k["norm"], None, kq.levels),
        Codes(CODEBOOK, vq.mse_bits, vq.dim, v["codes"], v["norm"], None, vq.levels),
    )
    if out is None:
        return None
    o, m, l = out
    return vq.rotation.inverse(o), m, l


def encode_codes(quant: SphereQuantizer, y: mx.array) -> mx.array | None:
    """Packed Lloyd-Max codes of rotated unit vectors ``y`` (GPU kernel), or None.

    Shapes:
        y ``(..., T, dim)`` float32; returns ``(..., T, ceil(dim * bits / 32))`` uint32.
    """
    if not use_kernels() or quant.codebook is None or quant.sketch is not None:
        return None
    return codebook_encode(y, quant.bounds, quant.mse_bits)
