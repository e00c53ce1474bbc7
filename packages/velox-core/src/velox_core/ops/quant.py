"""Uniform affine quantization in groups, along tokens or along channels, with clipping.

``axis="token"`` groups ``group`` consecutive channels of one token (per-token quantization,
as ``mx.quantize`` does); ``axis="channel"`` groups ``group`` consecutive tokens of one
channel (per-channel quantization, as KIVI does for keys, arXiv 2402.02750).
A value is stored as ``x_hat = scale * code + zero`` with ``code`` in ``[0, 2**bits)``.
Clipping (SKVQ, arXiv 2405.06219) scales a group's min and max by ``clip`` in ``(0, 1]``
before the grid is laid, trading the error of outliers for resolution elsewhere.
"""

from __future__ import annotations

import mlx.core as mx

from ..validation import check_array, check_bits, check_choice, check_float, check_int

__all__: list[str] = []

AXES = ("token", "channel")


def scale_dtype(dtype: mx.Dtype) -> mx.Dtype:
    """Scales and zeros are kept in bfloat16 for bfloat16 inputs, float16 otherwise."""
    return mx.bfloat16 if dtype == mx.bfloat16 else mx.float16


def _grouped(x: mx.array, group: int, axis: str) -> mx.array:
    *lead, t, d = x.shape
    if axis == "token":
        if d % group:
            raise ValueError(f"group={group} must divide the head dim {d} (axis='token')")
        return x.reshape(*lead, t, d // group, group)
    if t % group:
        raise ValueError(f"group={group} must divide the token count {t} (axis='channel')")
    return x.reshape(*lead, t // group, group, d)


def affine_quantize(
    x: mx.array, bits: int, group: int, axis: str = "token", clip: float = 1.0
) -> tuple[mx.array, mx.array, mx.array]:
    """Quantize ``x`` to ``bits``-bit codes with one (scale, zero) per group.

    Shapes:
        x: ``(..., T, D)``.
        returns ``codes`` uint8 ``(..., T, D)``, and ``scale``, ``zero`` of shape
        ``(..., T, D // group)`` for ``axis="token"`` or ``(..., T // group, D)`` for
        ``axis="channel"``, in :func:`scale_dtype` of ``x.dtype``.
    """
    check_array("x", x, min_ndim=2)
    check_bits("bits", bits)
    check_int("group", group, minimum=1)
    check_choice("axis", axis, AXES)
    check_float("clip", clip, minimum=0.0, maximum=1.0, open_min=True)
    g = _grouped(x.astype(mx.float32), group, axis)
    red = -1 if axis == "token" else -2
    lo = mx.min(g, axis=red, keepdims=True) * clip
    hi = mx.max(g, axis=red, keepdims=True) * clip
    levels = (1 << bits) - 1
    sdt = scale_dtype(x.dtype)
    scale = mx.maximum((hi - lo) / levels, 1e-8).astype(sdt)
    zero = lo.astype(sdt)
    # quantize against the stored (rounded) scale and zero so decode matches exactly
    codes = mx.clip(mx.round((g - zero.astype(mx.float32)) / scale.astype(mx.float32)), 0, levels)
    codes = codes.astype(mx.uint8).reshape(x.shape)
    return codes, mx.squeeze(scale, red), mx.squeeze(zero, red)


def affine_dequantize(
    codes: mx.array, scale: mx.array, zero: mx.array, group: int, axis: str = "token"
) -> mx.array:
    """Inverse of :func:`affine_quantize` (up to the quantization error).

    Shapes:
        codes ``(..., T, D)``; scale and zero as returned by :func:`affine_quantize`;
        returns float32 ``(..., T, D)``.
    """
    check_choice("axis", axis, AXES)
    g = _grouped(codes.astype(mx.float32), group, axis)
    red = -1 if axis == "token" else -2
    s = mx.expand_dims(scale.astype(mx.float32), red)
    z = mx.expand_dims(zero.astype(mx.float32), red)
    return (g * s + z).reshape(codes.shape)


def affine_matmul(
    x: mx.array,
    codes: mx.array,
    scale: mx.array,
    zero: mx.array,
    bits: int,
    group: int,
    transpose: bool,
) -> mx.array:
    """``x @ w.T`` (``transpose``) or ``x @ w`` with ``w`` the per-token affine codes' values
    (``scale * code + zero``), read from the packed words by ``mx.quantized_matmul``: the
    words must be in MLX's layout (:func:`velox_core.ops.packing.mlx_readable`).

    Shapes:
        x ``(..., M, D)`` (``transpose``) or ``(..., M, T)``; codes uint32 ``(..., T,
        D * bits / 32)``; scale and zero ``(..., T, D / group)``; returns ``(..., M, T)`` or
        ``(..., M, D)``.
    """
    return mx.quantized_matmul(
        x, codes, scale, zero, transpose=transpose, group_size=group, bits=bits
    )
