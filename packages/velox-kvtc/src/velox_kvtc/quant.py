"""KVTC's scalar quantizers of PCA coefficients: one data type per group of components.

A group is ``s`` consecutive PCA components of one token. Its data type is one of

* ``"zero"``: dropped (reconstructed as 0, the mean's value); no bits;
* ``"int<b>"`` (``b`` = 1..8): uniform affine over the group's own range in that token: the
  minimum ``lo`` and the step ``(max - lo) / (2^b - 1)`` are stored as float16 (the 32 bits of
  a per-group shift and scale, as microscaling formats keep one per block) and each component
  as a ``b``-bit code ``round((x - lo) / step)``;
* ``"fp8"``: each component cast to float8 e4m3 (saturating at +-448), no scale.

:func:`bits` is what the bit allocation counts per token (codes plus shift and scale), and
:func:`quantize` / :func:`dequantize` are the one implementation both the allocation's error
tables (:mod:`velox_kvtc.allocation`) and the coder (:mod:`velox_kvtc.codec`) use, so the
error the allocation predicts on calibration rows is the error the coder makes on them.
"""

from __future__ import annotations

import mlx.core as mx

__all__ = ["DTYPES", "SCALE_BITS", "bits", "check_dtype", "dequantize", "quantize", "symbol_bits"]

DTYPES = ("zero", *(f"int{b}" for b in range(1, 9)), "fp8")
SCALE_BITS = 32  # a float16 shift and a float16 scale per group and token
_FP16_MAX = 65504.0


def check_dtype(name: str, where: str = "dtype") -> str:
    """``name`` if it is a known data type, else ``ValueError`` listing them."""
    if not isinstance(name, str) or name not in DTYPES:
        raise ValueError(f"{where} must be one of {', '.join(DTYPES)}, got {name!r}")
    return name


def symbol_bits(dtype: str) -> int:
    """Bits of one component's code: 0 (zero), ``b`` (int<b>) or 8 (fp8)."""
    check_dtype(dtype)
    if dtype == "zero":
        return 0
    return 8 if dtype == "fp8" else int(dtype[3:])


def bits(size: int, dtype: str) -> int:
    """Bits per token of a group of ``size`` components: codes plus, for an ``int<b>``
    group, its float16 shift and scale."""
    b = symbol_bits(dtype)
    return size * b + (SCALE_BITS if dtype.startswith("int") else 0)


def quantize(x: mx.array, dtype: str) -> tuple[mx.array, mx.array | None, mx.array | None]:
    """Codes of groups of components.

    Shapes:
        x float32 ``(..., s)``: one group per leading index; returns codes uint8 ``(..., s)``
        (``int<b>``: ``0 .. 2^b - 1``; ``fp8``: e4m3 bit patterns; ``zero``: all 0) and, for
        ``int<b>``, the float16 shift and scale ``(...)`` (None otherwise).

    Raises:
        ValueError: a group's range does not fit float16 (|coefficient| above 65504).
    """
    check_dtype(dtype)
    x = x.astype(mx.float32)
    if dtype == "zero":
        return mx.zeros(x.shape, mx.uint8), None, None
    if dtype == "fp8":
        return mx.to_fp8(mx.clip(x, -448.0, 448.0)), None, None
    levels = (1 << int(dtype[3:])) - 1
    lo = x.min(axis=-1)
    hi = x.max(axis=-1)
    if mx.any(mx.maximum(mx.abs(lo), mx.abs(hi)) > _FP16_MAX).item():
        raise ValueError("kvtc: a PCA coefficient exceeds the float16 range of the group shift")
    lo16 = lo.astype(mx.float16)
    step16 = ((hi - lo16.astype(mx.float32)) / levels).astype(mx.float16)
    step = step16.astype(mx.float32)[..., None]
    safe = mx.where(step > 0, step, 1.0)
    q = mx.round((x - lo16.astype(mx.float32)[..., None]) / safe)
    q = mx.where(step > 0, mx.clip(q, 0, levels), 0).astype(mx.uint8)
    return q, lo16, step16


def dequantize(
    codes: mx.array, dtype: str, shift: mx.array | None = None, scale: mx.array | None = None
) -> mx.array:
    """Inverse of :func:`quantize`.

    Shapes:
        codes uint8 ``(..., s)``; shift, scale float16 ``(...)`` for ``int<b>``; returns
        float32 ``(..., s)``.
    """
    check_dtype(dtype)
    if dtype == "zero":
        return mx.zeros(codes.shape, mx.float32)
    if dtype == "fp8":
        return mx.from_fp8(codes, dtype=mx.float32)
    if shift is None or scale is None:
        raise ValueError(f"kvtc: an {dtype} group needs its shift and scale")
    lo = shift.astype(mx.float32)[..., None]
    return lo + codes.astype(mx.float32) * scale.astype(mx.float32)[..., None]
