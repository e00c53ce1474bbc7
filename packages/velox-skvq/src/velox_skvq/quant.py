"""Clipped dynamic group quantization (SKVQ, arXiv 2405.06219) and the code packing.

A group is ``group`` consecutive (reordered) channels of one token. Its range is measured when
the token is coded (dynamic quantization) and shrunk by the group's clipping factor ``a``:
``lo = a * min``, ``hi = a * max``, ``scale = (hi - lo) / levels``, ``x_hat = scale * code + lo``
with ``code = clamp(round((x - lo) / scale), 0, levels)``. ``levels`` is ``2**bits - 1``, or 2
for the paper's 1.5-bit codes (three levels). The factors are fitted once per channel group by
:func:`search_clip`: for each group, the factor of the grid with the least squared
reconstruction error over the calibration tokens.

Integer widths are bit-packed with :func:`velox_core.ops.pack` (MLX's layout, so
``mx.quantized_matmul`` reads them); three-level codes are packed five to a byte in base 3
(``3**5 = 243 <= 256``), 1.6 bits per code.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from velox_core.ops import pack, unpack

from .config import TERNARY

__all__ = [
    "clip_grid",
    "dequantize",
    "levels",
    "pack_codes",
    "quantize",
    "search_clip",
    "strided",
    "unpack_codes",
]

_TRITS = 5  # ternary codes per byte
_POW3 = (1, 3, 9, 27, 81)


def levels(bits: int | float) -> int:
    """The largest code: ``2**bits - 1``, or 2 for 1.5-bit (ternary) codes."""
    return 2 if bits == TERNARY else (1 << int(bits)) - 1


def clip_grid(clip_min: float) -> np.ndarray:
    """Clipping factors from 1.0 down to ``clip_min`` in steps of about 0.02, fp16-rounded."""
    n = max(1, round((1.0 - clip_min) / 0.02)) + 1 if clip_min < 1.0 else 1
    return np.linspace(1.0, clip_min, n).astype(np.float16)


def quantize(x: mx.array, clip: mx.array, top: int, group: int, sdt: mx.Dtype):
    """Per-token groups with per-group clipping factors.

    Shapes:
        x ``(B, J, T, D)`` float32; clip ``(B, J, D // group)``; returns uint8 codes
        ``(B, J, T, D)`` and ``scale``, ``zero`` ``(B, J, T, D // group)`` in ``sdt``.
    """
    b, j, t, d = x.shape
    g = x.reshape(b, j, t, d // group, group)
    a = clip.astype(mx.float32)[:, :, None, :, None]
    lo = mx.min(g, axis=-1, keepdims=True) * a
    hi = mx.max(g, axis=-1, keepdims=True) * a
    scale = ((hi - lo) / top).astype(sdt)
    zero = lo.astype(sdt)
    # codes against the stored (rounded) scale and zero, so decoding matches exactly
    s = scale.astype(mx.float32)
    q = mx.round((g - zero.astype(mx.float32)) / mx.where(s > 0, s, 1.0))
    codes = mx.where(s > 0, mx.clip(q, 0, top), 0).astype(mx.uint8).reshape(x.shape)
    return codes, scale.squeeze(-1), zero.squeeze(-1)


def dequantize(codes: mx.array, scale: mx.array, zero: mx.array, group: int) -> mx.array:
    """Shapes: codes ``(..., T, D)``, scale/zero ``(..., T, D // group)``; returns float32."""
    *lead, d = codes.shape
    c = codes.astype(mx.float32).reshape(*lead, d // group, group)
    s = scale.astype(mx.float32)[..., None]
    z = zero.astype(mx.float32)[..., None]
    return (c * s + z).reshape(codes.shape)


def search_clip(x: mx.array, grid: np.ndarray, top: int, group: int, sdt: mx.Dtype) -> mx.array:
    """Per channel group, the factor of ``grid`` with the least squared reconstruction error
    summed over the tokens of ``x`` (ties go to the larger factor, 1.0 first).

    Shapes:
        x ``(B, J, T, D)`` float32 calibration tokens (reordered); returns ``(B, J, D // group)``
        in ``sdt``.
    """
    b, j, t, d = x.shape
    errs = []
    for a in grid:
        clip = mx.full((b, j, d // group), float(a), dtype=sdt)
        codes, scale, zero = quantize(x, clip, top, group, sdt)
        e = (dequantize(codes, scale, zero, group) - x) ** 2
        errs.append(mx.sum(e.reshape(b, j, t, d // group, group), axis=(2, 4)))
    best = mx.argmin(mx.stack(errs), axis=0)  # first minimum: the largest factor
    return mx.array(grid)[best].astype(sdt)


def pack_codes(codes: mx.array, bits: int | float) -> mx.array:
    """Shapes: codes ``(..., D)``; returns uint32 words, or uint8 base-3 bytes for 1.5 bits."""
    if bits != TERNARY:
        return pack(codes, int(bits))
    d = codes.shape[-1]
    pad = -d % _TRITS
    c = codes.astype(mx.uint32)
    if pad:
        c = mx.concatenate([c, mx.zeros((*c.shape[:-1], pad), dtype=mx.uint32)], axis=-1)
    c = c.reshape(*c.shape[:-1], -1, _TRITS)
    return mx.sum(c * mx.array(_POW3, dtype=mx.uint32), axis=-1).astype(mx.uint8)


def unpack_codes(words: mx.array, bits: int | float, d: int) -> mx.array:
    """Inverse of :func:`pack_codes`; returns uint8 codes ``(..., d)``."""
    if bits != TERNARY:
        return unpack(words, int(bits), d)
    w = words.astype(mx.uint32)[..., None]
    c = (w // mx.array(_POW3, dtype=mx.uint32)) % 3
    return c.reshape(*words.shape[:-1], -1)[..., :d].astype(mx.uint8)


def strided(x: mx.array, n: int) -> mx.array:
    """At most ``n`` tokens of ``x`` ``(B, H, T, D)``, evenly spread, first and last kept."""
    t = x.shape[2]
    if t <= n:
        return x
    return mx.take(x, mx.array(np.linspace(0, t - 1, n).round().astype(np.int32)), axis=2)
