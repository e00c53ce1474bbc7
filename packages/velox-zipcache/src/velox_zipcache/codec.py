"""ZipCache's mixed-precision block codecs: in each block of ``group`` tokens and each KV head,
the salient tokens are coded at ``bits`` and the others at ``low_bits``.

ZipCache (arXiv 2405.14256) quantizes the tokens it finds salient at a high width (4 bits)
and the rest at a low one (2 bits), each precision group with its own quantization
parameters. Here a block of ``group`` tokens holds exactly ``salient_count(group, salient)``
salient tokens per KV head (which ones: the cache's saliency, :mod:`velox_zipcache.saliency`),
so the two groups of every block have fixed sizes and the codes are two dense arrays:

* ``hi``: the salient tokens' codes at ``bits``, in ascending position, bit-packed per token,
  uint32 ``(B, H, P, s, ceil(D*bits/32))``;
* ``lo``: the other tokens' codes at ``low_bits``, likewise ``(B, H, P, g-s, ...)``;
* ``mask``: which of the block's tokens are salient, one bit each, uint32
  ``(B, H, P, ceil(g/32))`` (absent where every token or none is salient);

and the groups' parameters (fp16, bf16 for bf16 models), which differ by scheme:

* :class:`MixedChannel` (the paper's keys): channelwise, a scale and a minimum per channel
  for the salient group (``hi_scale``, ``hi_zero``) and for the regular group (``lo_scale``,
  ``lo_zero``), each ``(B, H, P, D)``;
* :class:`MixedSeparable` (the paper's values): channel-separable tokenwise, each channel of
  the block divided by ``c = sqrt(max |x|)`` over the block's tokens (``chan``, ``(B, H, P,
  D)``) and each token then quantized over its channels with a scale and a minimum of its
  own (``hi_scale``, ``hi_zero``: ``(B, H, P, s)``; ``lo_scale``, ``lo_zero``: ``(B, H, P,
  g-s)``); decoding multiplies ``c`` back.

Codes are rounded against the stored (rounded) scales and minima, so decoding matches the
encoder exactly. Every array is ``per_block``: the record's bytes are exactly what is held.
"""

from __future__ import annotations

import mlx.core as mx

from velox_core import Codec, Packed
from velox_core.ops import pack, unpack
from velox_core.ops.quant import scale_dtype
from velox_core.validation import check_array, check_bits, check_float, check_int

__all__ = ["MixedChannel", "MixedSeparable", "locality", "salient_count"]


def salient_count(group: int, salient: float) -> int:
    """Salient tokens per block: ``group`` minus the regular ones, ``int((1 - salient) *
    group)`` (the reference code's count, ``int(ratio * n)`` regular tokens), with a small
    epsilon so that ``0.4 * 100`` is 40 and not 39 under rounding."""
    return group - max(0, min(group, int((1.0 - salient) * group + 1e-6)))


def locality(b: int, h: int, t: int, group: int, count: int) -> mx.array:
    """The newest ``count`` tokens of each block salient (the paper's "locality" rule): the
    saliency of tokens no query has scored.

    Shapes: returns bool ``(B, H, T)``.
    """
    pos = mx.arange(t) % group
    return mx.broadcast_to(pos >= group - count, (b, h, t))


def _affine(x: mx.array, bits: int, axis: int, sdt: mx.Dtype):
    """Asymmetric ``bits``-bit codes of ``x`` with one scale and minimum along ``axis``.

    Shapes: x float32; returns uint8 codes like ``x`` and scale, minimum with ``axis`` kept
    (size 1), in ``sdt``.
    """
    lo = mx.min(x, axis=axis, keepdims=True)
    hi = mx.max(x, axis=axis, keepdims=True)
    levels = (1 << bits) - 1
    scale = ((hi - lo) / levels).astype(sdt)
    zero = lo.astype(sdt)
    # against the stored scale and minimum (a group whose scale rounds to 0 decodes to its
    # minimum whatever its codes)
    s = mx.maximum(scale.astype(mx.float32), 1e-30)
    q = mx.round((x - zero.astype(mx.float32)) / s)
    return mx.clip(q, 0, levels).astype(mx.uint8), scale, zero


class _Mixed(Codec):
    """The layout both schemes share (see the module): a subclass gives :meth:`_code` and
    :meth:`_values`.

    Args:
        bits: width of the salient tokens' codes, 2 to 8 (the paper: 4).
        low_bits: width of the other tokens' codes, 1 to ``bits`` (the paper: 2).
        salient: fraction of each block's tokens that are salient, in ``[0, 1]``.
        group: tokens per block (the paper's streaming interval, 100).
    """

    settings = ("bits", "low_bits", "salient", "group")

    def __init__(self, bits: int = 4, low_bits: int = 2, salient: float = 0.6, group: int = 100):
        self.bits = check_bits("bits", bits, minimum=2, maximum=8)
        self.low_bits = check_bits("low_bits", low_bits, minimum=1, maximum=self.bits)
        self.salient = check_float("salient", salient, minimum=0.0, maximum=1.0)
        self.group = check_int("group", group, minimum=1)
        self.block = self.group
        self.count = salient_count(self.group, self.salient)

    # -- coding ------------------------------------------------------------------------------
    def encode(self, x: mx.array, positions: mx.array | None = None) -> Packed:
        """Without a saliency (the codec alone): each block's newest tokens are salient
        (:func:`locality`); the cache codes through :meth:`encode_mixed`."""
        b, h, t, _ = x.shape
        return self.encode_mixed(x, locality(b, h, t, self.group, self.count))

    def encode_mixed(self, x: mx.array, salient: mx.array) -> Packed:
        """Code ``x`` with the given salient tokens, exactly ``self.count`` per block and head.

        Shapes: x ``(B, H, T, D)`` with ``T % group == 0``; salient bool ``(B, H, T)``.
        """
        check_array("salient", salient, ndim=3)
        b, h, t, d = x.shape
        g, s = self.group, self.count
        pages = x.astype(mx.float32).reshape(b, h, t // g, g, d)
        data: dict[str, mx.array] = {}
        if 0 < s < g:
            sal = salient.reshape(b, h, t // g, g)
            # the block's tokens reordered: the salient ones first, then the others, each in
            # ascending position (the order decode restores from the mask)
            order = mx.argsort(mx.where(sal, 0, g) + mx.arange(g), axis=-1)
            pages = mx.take_along_axis(pages, order[..., None], axis=3)
            data["mask"] = pack(sal.astype(mx.uint8), 1)
        data.update(self._code(pages, scale_dtype(x.dtype)))
        return Packed(data, t, g, frozenset(data))

    def _code(self, pages: mx.array, sdt: mx.Dtype) -> dict[str, mx.array]:
        """The codes and parameters of blocks whose salient tokens come first.

        Shapes: pages float32 ``(B, H, P, g, D)``.
        """
        raise NotImplementedError

    def _values(self, p: dict[str, mx.array], part: str, bits: int, n: int) -> mx.array:
        """One precision group's decoded tokens (before :meth:`_finish`).

        Shapes: returns float32 ``(B, H, P, n, D)``.
        """
        raise NotImplementedError

    def _finish(self, x: mx.array, p: dict[str, mx.array]) -> mx.array:
        """What applies to a whole decoded block (in temporal order)."""
        return x

    def _split(self, pages: mx.array) -> list[tuple[str, int, mx.array]]:
        """``(name, bits, tokens)`` of the salient and the regular group (the empty one left
        out)."""
        s = self.count
        parts = [("hi", self.bits, pages[:, :, :, :s]), ("lo", self.low_bits, pages[:, :, :, s:])]
        return [part for part in parts if part[2].shape[3]]

    def salient_mask(self, packed: Packed) -> mx.array:
        """Which tokens of a record are salient.

        Shapes: returns bool ``(B, H, T)``.
        """
        p = packed.data
        b, h = next(iter(p.values())).shape[:2]
        if "mask" in p:
            m = unpack(p["mask"], 1, self.group).astype(mx.bool_)
            return m.reshape(b, h, packed.tokens)
        return mx.full((b, h, packed.tokens), self.count == self.group, dtype=mx.bool_)

    def decode(self, packed: Packed) -> mx.array:
        p = packed.data
        g, s = self.group, self.count
        parts = []
        if s:
            parts.append(self._values(p, "hi", self.bits, s))
        if g - s:
            parts.append(self._values(p, "lo", self.low_bits, g - s))
        x = parts[0] if len(parts) == 1 else mx.concatenate(parts, axis=3)
        if "mask" in p:
            sal = unpack(p["mask"], 1, g).astype(mx.int32)  # (B, H, P, g)
            # each token's row among [salient | regular]: its rank within its group
            hi, lo = mx.cumsum(sal, axis=-1) - 1, s + mx.cumsum(1 - sal, axis=-1) - 1
            row = mx.where(sal > 0, hi, lo)
            x = mx.take_along_axis(x, row[..., None], axis=3)
        x = self._finish(x, p)
        b, h, pg, _, d = x.shape
        return x.reshape(b, h, pg * g, d)


class MixedChannel(_Mixed):
    """Channelwise codes in blocks (ZipCache's keys): per block, KV head and channel, a scale
    and a minimum over the salient tokens and another over the regular ones. Parameters: see
    the module and :class:`_Mixed`."""

    name = "zipcache-channel"

    def _code(self, pages: mx.array, sdt: mx.Dtype) -> dict[str, mx.array]:
        out = {}
        for name, bits, x in self._split(pages):
            codes, scale, zero = _affine(x, bits, 3, sdt)
            out[name] = pack(codes, bits)
            out[f"{name}_scale"], out[f"{name}_zero"] = scale.squeeze(3), zero.squeeze(3)
        return out

    def _values(self, p: dict[str, mx.array], part: str, bits: int, n: int) -> mx.array:
        s = p[f"{part}_scale"].astype(mx.float32)[:, :, :, None]
        z = p[f"{part}_zero"].astype(mx.float32)[:, :, :, None]
        c = unpack(p[part], bits, s.shape[-1]).astype(mx.float32)
        return c * s + z


class MixedSeparable(_Mixed):
    """Channel-separable tokenwise codes in blocks (ZipCache's values): per block and KV head,
    each channel divided by ``sqrt(max |x|)`` over the block's tokens, then each token coded
    over its channels with its own scale and minimum. Parameters: see the module and
    :class:`_Mixed`."""

    name = "zipcache-separable"

    def _code(self, pages: mx.array, sdt: mx.Dtype) -> dict[str, mx.array]:
        chan = mx.sqrt(mx.max(mx.abs(pages), axis=3, keepdims=True)).astype(sdt)
        c = chan.astype(mx.float32)
        x = mx.where(c > 0, pages / mx.maximum(c, 1e-30), 0.0)  # a zero channel stays zero
        out = {"chan": chan.squeeze(3)}
        for name, bits, part in self._split(x):
            codes, scale, zero = _affine(part, bits, 4, sdt)
            out[name] = pack(codes, bits)
            out[f"{name}_scale"], out[f"{name}_zero"] = scale.squeeze(4), zero.squeeze(4)
        return out

    def _values(self, p: dict[str, mx.array], part: str, bits: int, n: int) -> mx.array:
        s = p[f"{part}_scale"].astype(mx.float32)[..., None]
        z = p[f"{part}_zero"].astype(mx.float32)[..., None]
        c = unpack(p[part], bits, p["chan"].shape[-1]).astype(mx.float32)
        return c * s + z

    def _finish(self, x: mx.array, p: dict[str, mx.array]) -> mx.array:
        return x * p["chan"].astype(mx.float32)[:, :, :, None]
