"""Encode kernels: quantize and bit-pack in one pass, matching the MLX reference bit for bit.

* :func:`affine_encode`: :func:`velox_core.ops.affine_quantize` (``axis="token"``) followed by
  :func:`velox_core.ops.pack` (``metal/encode_affine.metal``).
* :func:`codebook_encode`: :meth:`velox_core.ops.Codebook.encode` followed by
  :func:`velox_core.ops.pack` (``metal/encode_codebook.metal``).
* :func:`vq_encode`: the nearest codeword of every sub-vector (:func:`velox_core.ops.assign`)
  followed by :func:`velox_core.ops.pack` (``metal/encode_vq.metal``).

Both return None where the kernel does not apply (the caller then runs the reference). The
affine kernel computes the same float32 operations as the reference in the same order
(IEEE division, ties to even), so codes, scales and zeros are identical wherever the backend's
division is correctly rounded; the codebook kernel compares against the same thresholds, so
its codes are identical everywhere. The VQ kernel ranks codewords by the exact float32
squared distance, where the reference ranks ``||c||^2 - 2 y.c`` from a matmul: the two agree
except where two codewords are equally near within rounding.
"""

from __future__ import annotations

import struct

import mlx.core as mx

from ..ops.quant import scale_dtype
from .build import KernelSpec

__all__ = [
    "AFFINE_ENCODE",
    "CODEBOOK_ENCODE",
    "VQ_ENCODE",
    "affine_encode",
    "codebook_encode",
    "vq_encode",
]

AFFINE_ENCODE = KernelSpec(
    name="velox_encode_affine",
    source="encode_affine.metal",
    inputs=("x",),
    outputs=("codes", "scale", "zero"),
)
CODEBOOK_ENCODE = KernelSpec(
    name="velox_encode_codebook",
    source="encode_codebook.metal",
    inputs=("y", "bounds"),
    outputs=("codes",),
)
VQ_ENCODE = KernelSpec(
    name="velox_encode_vq",
    source="encode_vq.metal",
    inputs=("y", "book"),
    outputs=("codes",),
)
THREADS = 64
_FLOATS = (mx.float16, mx.bfloat16, mx.float32)


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
    if x.dtype not in _FLOATS or not 1 <= bits <= 8 or group < 1 or dim % group:
        return None
    if not 0.0 < clip <= 1.0:
        return None
    rows = 1
    for n in lead:
        rows *= n
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


def codebook_encode(y: mx.array, bounds: mx.array, bits: int) -> mx.array | None:
    """Packed codebook codes of ``y`` along its last axis, or None if the kernel does not apply.

    Shapes:
        y ``(..., D)`` (cast to float32); bounds ``(2**bits - 1,)`` ascending thresholds;
        returns ``(..., ceil(D*bits/32))`` uint32.
    """
    *lead, dim = y.shape
    if not 1 <= bits <= 8 or bounds.shape != ((1 << bits) - 1,):
        return None
    rows = 1
    for n in lead:
        rows *= n
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


def vq_encode(y: mx.array, book: mx.array, bits: int, group: int) -> mx.array | None:
    """Packed indices of the nearest codewords of ``y``'s sub-vectors, or None if the kernel
    does not apply.

    Shapes:
        y ``(B, H, T, D)`` (cast to float32), ``group`` dividing ``D``; book ``(B, H,
        2**bits, group)`` (one codebook per batch row and head); returns ``(B, H, T,
        ceil((D / group) * bits / 32))`` uint32.
    """
    if y.ndim != 4 or not 1 <= bits <= 8 or group < 1 or y.shape[-1] % group:
        return None
    b, h, t, dim = y.shape
    if tuple(book.shape) != (b, h, 1 << bits, group) or b * h * t == 0:
        return None
    words = -(-(dim // group) * bits // 32)
    (codes,) = VQ_ENCODE.kernel()(
        inputs=[
            y.astype(mx.float32).reshape(b * h, t, dim),
            book.astype(mx.float32).reshape(b * h, 1 << bits, group),
        ],
        template=[("BITS", bits), ("GROUP", group), ("HD", dim)],
        grid=(b * h * t * words, 1, 1),
        threadgroup=(THREADS, 1, 1),
        output_shapes=[(b, h, t, words)],
        output_dtypes=[mx.uint32],
    )
    return codes
