"""Encode kernels: quantize and bit-pack in one pass, matching the MLX reference bit for bit.

* :func:`affine_encode`: :func:`velox_core.ops.affine_quantize` (``axis="token"``) followed by
  :func:`velox_core.ops.pack` (``metal/encode_affine.metal``).
* :func:`sketch_encode`: keys' Johnson-Lindenstrauss sign sketches
  (:func:`velox_core.ops.sign_sketch` followed by ``pack(bits, 1)``) and norms, of the inlier
  part and of the given outlier channels (``metal/encode_sketch.metal``).

Both return None where the kernel does not apply (the caller then runs the reference). The
affine kernel computes the same float32 operations as the reference in the same order
(IEEE division, ties to even), so codes, scales and zeros are identical wherever the backend's
division is correctly rounded. The sketch kernel sums ``S x`` in channel order where the
reference's matmul sums in its own: a sign bit can differ only where ``|S x|`` is within
float32 rounding of 0, a norm by a rounding of its dtype.

An encode kernel that only one method uses (a codebook or vector-quantization encode) lives
in that method's package, built with the same :class:`KernelSpec` machinery.
"""

from __future__ import annotations

import math
import struct

import mlx.core as mx

from ..ops.quant import scale_dtype
from .build import KernelSpec

__all__ = ["sketch_encode"]

AFFINE_ENCODE = KernelSpec(
    name="velox_encode_affine",
    source="encode_affine.metal",
    inputs=("x",),
    outputs=("codes", "scale", "zero"),
)
SKETCH_ENCODE = KernelSpec(
    name="velox_encode_sketch",
    source="encode_sketch.metal",
    inputs=("x", "s", "idx"),
    outputs=("sign", "norm", "osign", "onorm"),
)
THREADS = 64
FLOATS = (mx.float16, mx.bfloat16, mx.float32)


def clip_bits(clip: float) -> int:
    """The float32 bit pattern of ``clip`` as a (positive) int template argument."""
    return struct.unpack("<i", struct.pack("<f", float(clip)))[0]


def affine_encode(
    x: mx.array, bits: int, group: int, clip: float = 1.0
) -> tuple[mx.array, mx.array, mx.array] | None:
    """Packed affine codes of ``x`` along its last axis, or None if the kernel does not apply.

    Shapes:
        x ``(..., D)`` float16/bfloat16/float32 with ``group`` dividing ``D``; returns packed
        codes ``(..., ceil(D*bits/32))`` uint32 and scale, zero ``(..., D // group)`` in
        :func:`velox_core.ops.scale_dtype` of ``x.dtype``.
    """
    *lead, dim = x.shape
    if x.dtype not in FLOATS or not 1 <= bits <= 8 or group < 1 or dim % group:
        return None
    if not 0.0 < clip <= 1.0:
        return None
    rows = math.prod(lead)
    if rows == 0:
        return None
    words = -(-dim * bits // 32)
    sdt = scale_dtype(x.dtype)
    codes, scale, zero = AFFINE_ENCODE.kernel()(
        inputs=[x.reshape(rows, dim)],
        template=[
            ("BITS", bits),
            ("HD", dim),
            ("GROUP", group),
            ("CLIPB", clip_bits(clip)),
            ("ST", sdt),
        ],
        grid=(rows, 1, 1),
        threadgroup=(min(THREADS, rows), 1, 1),
        # outputs in their final shapes (the kernel writes rows in order): no reshapes
        output_shapes=[(*lead, words), (*lead, dim // group), (*lead, dim // group)],
        output_dtypes=[mx.uint32, sdt, sdt],
    )
    return codes, scale, zero


def sketch_encode(
    x: mx.array,
    s: mx.array,
    m: int,
    idx: mx.array | None = None,
    mo: int = 0,
    group: int = 1,
) -> tuple[mx.array, mx.array, mx.array | None, mx.array | None] | None:
    """Keys' packed sign sketches and norms in one launch, or None if the kernel does not
    apply.

    With outliers (``idx`` given), token ``t``'s outlier channels are ``idx[..., t // group,
    :]``; the main sketch is of the token with them zeroed (``x_in``), the outlier sketch of
    the token on them only (``x_o``). Without, ``x_in`` is the token.

    Shapes:
        x ``(..., T, D)`` float16/bfloat16/float32; s ``(R, D)`` (the projection, float16)
        with ``R >= max(m, mo)``; idx ``(..., T // group, k)`` int32, sorted ascending and
        distinct along the last axis, ``group`` dividing ``T``. Returns sign
        ``(..., T, ceil(m / 32))`` uint32 (``pack(sign_sketch(x_in, s[:m]), 1)``), norm
        ``(..., T)`` ``||x_in||``, and with outliers osign ``(..., T, ceil(mo / 32))`` uint32
        and onorm ``(..., T)`` ``||x_o||`` (else None, None); norms in
        :func:`velox_core.ops.scale_dtype` of ``x.dtype``.
    """
    if x.ndim < 2 or x.dtype not in FLOATS or s.dtype not in FLOATS or s.ndim != 2:
        return None
    *lead, t, dim = x.shape
    if m < 1 or s.shape[1] != dim:
        return None
    k = 0
    if idx is not None:
        k = idx.shape[-1] if idx.ndim == x.ndim else 0
        if k < 1 or k >= dim or mo < 1 or group < 1 or t % group:
            return None
        if tuple(idx.shape) != (*lead, t // group, k):
            return None
    if s.shape[0] < max(m, mo if k else 0):
        return None
    rows = t * math.prod(lead)
    words = -(-m // 32)
    owords = -(-mo // 32) if k else 0
    if rows == 0 or rows * (words + owords) >= 1 << 31:  # (the grid's x is a 32-bit int)
        return None
    ndt = scale_dtype(x.dtype)
    ins = [x.reshape(rows, dim), s]
    if k:
        ins.append(idx.astype(mx.int32).reshape(rows // group, k))
    else:
        ins.append(mx.zeros((1,), mx.int32))  # (unread)
    sign, norm, osign, onorm = SKETCH_ENCODE.kernel()(
        inputs=ins,
        template=[
            ("D", dim),
            ("M", m),
            ("MO", mo if k else 0),
            ("K", k),
            ("GROUP", group if k else 1),
            ("NT", ndt),
        ],
        grid=(rows * (words + owords), 1, 1),
        threadgroup=(THREADS, 1, 1),
        output_shapes=[
            (*lead, t, words),
            (*lead, t),
            (*lead, t, owords) if k else (1,),
            (*lead, t) if k else (1,),
        ],
        output_dtypes=[mx.uint32, ndt, mx.uint32, ndt],
    )
    if not k:
        return sign, norm, None, None
    return sign, norm, osign, onorm
