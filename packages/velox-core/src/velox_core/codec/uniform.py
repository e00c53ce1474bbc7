"""``Uniform``: affine per-group quantization (2 to 8 bits) along tokens or channels.

Codes are bit-packed into uint32 words (:mod:`velox_core.ops.packing`); each group keeps a
scale and a zero in fp16 (bf16 for bf16 models). With ``axis="token"`` a group is ``group``
channels of one token; with ``axis="channel"`` it is ``group`` tokens of one channel, so
tokens are coded ``group`` at a time (``block = group``).

Attention reads the codes directly: per-token groups go through ``mx.quantized_matmul``
(whose bit layout is ours for 2-6 and 8 bits) and per-channel groups fold the scales into
the query (``q . (s * c + z) = (q * s) . c + q . z``).

On a GPU with kernels enabled (:func:`velox_core.kernels.use_kernels`), per-token codes are
encoded by one fused quantize-and-pack kernel (bit for bit the reference), and decode steps
attend through the fused split-K kernel of :mod:`velox_core.kernels.decode`
(:meth:`Uniform.kernel_keys`, :meth:`Uniform.kernel_values`).
"""

from __future__ import annotations

import mlx.core as mx

from ..kernels import encode as _ke
from ..kernels import use_kernels
from ..kernels.joint import KernelSide
from ..kernels.records import AffineCodes, ChannelAffineCodes, CodeRecord
from ..ops.packing import (
    BYTE_BITS,
    byte_table,
    lookup,
    mlx_layout,
    mlx_readable,
    pack,
    unpack,
)
from ..ops.quant import AXES, affine_dequantize, affine_matmul, affine_quantize, scale_dtype
from ..validation import check_bits, check_choice, check_float, check_int
from .base import Codec, Packed

__all__: list[str] = []


def channel_group_scores(q: mx.array, c: mx.array, s: mx.array, z: mx.array) -> mx.array:
    """``q . k`` for keys coded per channel in groups of ``g`` tokens (``k = c * s + z``, KIVI's
    keys' layout), each group's scales folded into the query: ``(q * s) . c + q . z``.

    Shapes:
        q ``(B, H, M, D)``; c float32 ``(B, H, T/g, g, D)``, s and z ``(B, H, T/g, 1, D)``;
        returns ``(B, H, M, T)``.
    """
    qg = q[:, :, None]  # (B, H, 1, M, D)
    out = (qg * s) @ mx.swapaxes(c, -1, -2) + mx.sum(qg * z, axis=-1, keepdims=True)
    b, h = q.shape[:2]
    return mx.swapaxes(out, 2, 3).reshape(b, h, q.shape[2], c.shape[2] * c.shape[3])


def channel_group_mix(w: mx.array, c: mx.array, s: mx.array, z: mx.array) -> mx.array:
    """``w @ v`` for values coded per channel in groups of ``g`` tokens (``v = c * s + z``):
    per group ``(w @ c) * s + (sum of w) * z``, summed over the groups.

    Shapes:
        w ``(B, H, M, T)``; c float32 ``(B, H, T/g, g, D)``, s and z ``(B, H, T/g, 1, D)``;
        returns ``(B, H, M, D)``.
    """
    b, h, m, t = w.shape
    g = c.shape[3]
    wg = mx.swapaxes(w.reshape(b, h, m, t // g, g), 2, 3)  # (B, H, T/g, M, g)
    out = (wg @ c) * s + mx.sum(wg, axis=-1, keepdims=True) * z  # (B, H, T/g, M, D)
    return mx.sum(out, axis=2)


class Uniform(Codec):
    """Affine per-group quantization.

    Args:
        bits: code width, 2 to 8.
        group: group size (channels per group for ``axis="token"``, tokens for ``"channel"``).
        axis: ``"token"`` (per-token groups) or ``"channel"`` (per-channel groups).
        clip: factor in ``(0, 1]`` applied to each group's min and max before quantizing.
    """

    name = "uniform"
    settings = ("bits", "group", "axis", "clip")
    compressed_scores = True
    compressed_mix = True
    # per-token groups decode each token from its own codes, scales and zeros; per-channel
    # groups (KIVI's keys) each block of ``group`` tokens from its own: a block-aligned slice
    # decodes on its own
    decodes_slices = True

    def __init__(self, bits: int = 4, group: int = 64, axis: str = "token", clip: float = 1.0):
        self.bits = check_bits("bits", bits, minimum=2, maximum=8)
        self.group = check_int("group", group, minimum=1)
        self.axis = check_choice("axis", axis, AXES)
        self.clip = check_float("clip", clip, minimum=0.0, maximum=1.0, open_min=True)
        self.block = self.group if axis == "channel" else 1
        self._byte_tables: dict[mx.Dtype, mx.array] = {}  # per dtype: byte_table of the codes

    def check(self, dim: int, dtype: mx.Dtype) -> None:
        if self.axis == "token" and dim % self.group:
            raise ValueError(
                f"uniform: group={self.group} must divide the head dim {dim} "
                f"(choose a divisor of {dim}, e.g. {_divisors(dim)})"
            )

    def encode(self, x: mx.array, positions: mx.array | None = None) -> Packed:
        if self.axis == "token" and use_kernels():
            fused = _ke.affine_encode(x, self.bits, self.group, self.clip)
            if fused is not None:
                codes, scale, zero = fused
                return Packed({"codes": codes, "scale": scale, "zero": zero}, x.shape[2])
        codes, scale, zero = affine_quantize(x, self.bits, self.group, self.axis, self.clip)
        data = {"codes": pack(codes, self.bits), "scale": scale, "zero": zero}
        per_block = frozenset({"scale", "zero"}) if self.axis == "channel" else frozenset()
        return Packed(data, x.shape[2], self.block, per_block)

    def _codes(self, packed: Packed) -> mx.array:
        d = packed.data["scale"].shape[-1] * (self.group if self.axis == "token" else 1)
        return unpack(packed.data["codes"], self.bits, d)

    def decode(self, packed: Packed) -> mx.array:
        p = packed.data
        return affine_dequantize(self._codes(packed), p["scale"], p["zero"], self.group, self.axis)

    def decode_as(self, packed: Packed, dtype: mx.Dtype) -> mx.array:
        """Per-token codes in MLX's layout: ``mx.dequantize`` straight to the scales' dtype
        (one op, no float32 copy of the block), then ``dtype``; others as :meth:`decode`."""
        p = packed.data
        if self.axis == "token" and mlx_layout(self.bits, self.group):
            out = mx.dequantize(
                p["codes"], p["scale"], p["zero"], group_size=self.group, bits=self.bits
            )
            return out if out.dtype == dtype else out.astype(dtype)
        if self.axis == "channel" and self.bits in BYTE_BITS:
            # per-channel scales over groups of tokens: the codes' values a byte per gather,
            # scaled in ``dtype`` (no unpacked or float32 copy of the block)
            if dtype not in self._byte_tables:
                values = mx.arange(1 << self.bits, dtype=mx.float32).astype(dtype)
                self._byte_tables[dtype] = byte_table(values, self.bits)
            d = p["scale"].shape[-1]
            x = lookup(p["codes"], self.bits, d, self._byte_tables[dtype])  # (B, H, T, D)
            *lead, t, _ = x.shape
            g = x.reshape(*lead, t // self.group, self.group, d)
            s, z = (p[n].astype(dtype)[..., None, :] for n in ("scale", "zero"))
            return (g * s + z).reshape(x.shape)
        return super().decode_as(packed, dtype)

    def _mlx_layout(self) -> bool:
        return self.axis == "token" and mlx_readable(self.bits, self.group)

    def _matmul(self, x: mx.array, packed: Packed, transpose: bool) -> mx.array:
        p = packed.data
        return affine_matmul(x, p["codes"], p["scale"], p["zero"], self.bits, self.group, transpose)

    def _channel_groups(self, packed: Packed) -> tuple[mx.array, mx.array, mx.array]:
        """Per-channel records by token group: codes float32 ``(B, H, T/g, g, D)``, scale and
        zero float32 ``(B, H, T/g, 1, D)``."""
        p = packed.data
        b, h, t = p["codes"].shape[:3]
        c = self._codes(packed).astype(mx.float32).reshape(b, h, t // self.group, self.group, -1)
        s = p["scale"].astype(mx.float32)[:, :, :, None, :]
        z = p["zero"].astype(mx.float32)[:, :, :, None, :]
        return c, s, z

    def scores(self, q: mx.array, packed: Packed) -> mx.array:
        return self._from_codes(q, packed, transpose=True)

    def mix(self, w: mx.array, packed: Packed) -> mx.array:
        return self._from_codes(w, packed, transpose=False)

    def _from_codes(self, x: mx.array, packed: Packed, transpose: bool) -> mx.array:
        """:meth:`scores` (``transpose``: ``x`` the queries) or :meth:`mix` (``x`` the weights)
        by the codes' layout: ``mx.quantized_matmul`` where it reads them, the base codec's
        for other per-token groups; per-channel groups fold each token group's scales into the
        query (:func:`channel_group_scores`) or sum the weights of each token group against
        the zeros (:func:`channel_group_mix`)."""
        if self._mlx_layout():
            return self._matmul(x, packed, transpose)
        if self.axis == "token":
            return super().scores(x, packed) if transpose else super().mix(x, packed)
        groups = self._channel_groups(packed)
        return channel_group_scores(x, *groups) if transpose else channel_group_mix(x, *groups)

    def kernel_values(self, packed: Packed, dim: int) -> KernelSide | None:
        """Per-token codes: the decode kernels mix them (:meth:`kernel_codes`); per-channel
        groups (KIVI's keys' layout) only as keys."""
        return KernelSide(self.kernel_codes(packed)) if self.axis == "token" else None

    def kernel_keys(self, packed: Packed, q_shape, values: CodeRecord) -> KernelSide | None:
        """Affine codes, per token or per channel (KIVI's keys: the tensor-core kernel reads
        them on CUDA where the plan allows, the portable kernel elsewhere), beside per-token
        affine values."""
        return KernelSide(self.kernel_codes(packed)) if type(values) is AffineCodes else None

    def kernel_codes(self, packed: Packed) -> AffineCodes | ChannelAffineCodes:
        """The decode kernels' view of one of this codec's records: affine codes with their
        scales and zeros, per token (``velox_core.kernels.records.AffineCodes``) or
        (``axis="channel"``, keys only) per channel (``ChannelAffineCodes``)."""
        p = packed.data
        record = AffineCodes if self.axis == "token" else ChannelAffineCodes
        return record(
            bits=self.bits, group=self.group, codes=p["codes"], scale=p["scale"], zero=p["zero"]
        )


def _divisors(n: int) -> str:
    return ", ".join(str(d) for d in (16, 32, 64, 128) if n % d == 0) or "1"


class MLXGrid(Uniform):
    """``Uniform`` per-token codes of 2 to 6 bits laid by MLX's own ``mx.quantize`` (groups of
    32, 64 or 128, no clip): one op a token, where a call of velox's encode kernel costs the
    host several times that (measured on CUDA) on every decode step of a cache that codes
    each token on arrival. The records are ``Uniform``'s
    (``scale * code + zero``, MLX's bias as the zero). MLX places its grid so that the
    group's edge of larger magnitude is exact and rounds the scale after coding, velox from
    the group's min against the rounded scale; 8-bit codes keep velox's grid, with which the
    8-bit cache gives fp16's greedy tokens (test_latent_cache.py)."""

    def encode(self, x: mx.array, positions: mx.array | None = None) -> Packed:
        if (
            self.bits > 6
            or self.axis != "token"
            or self.clip != 1.0
            or not mlx_layout(self.bits, self.group)
        ):
            return super().encode(x, positions)
        codes, scale, zero = mx.quantize(x, group_size=self.group, bits=self.bits)
        sdt = scale_dtype(x.dtype)
        if scale.dtype != sdt:
            scale, zero = scale.astype(sdt), zero.astype(sdt)
        return Packed({"codes": codes, "scale": scale, "zero": zero}, x.shape[2])
