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

Attention reads the codes (:class:`~velox_zipcache.blocks.MixedBlocks`).
"""

from __future__ import annotations

import mlx.core as mx

from velox_core.ops import unpack

from .blocks import MixedBlocks, codes_matmul

__all__ = ["MixedChannel", "MixedSeparable"]


class MixedChannel(MixedBlocks):
    """Channelwise codes in blocks (ZipCache's keys): per block, KV head and channel, a scale
    and a minimum over the salient tokens and another over the regular ones. Parameters: see
    the module and :class:`~velox_zipcache.blocks.MixedBlocks`."""

    name = "zipcache-channel"

    def _code(self, pages: mx.array, sdt: mx.Dtype) -> dict[str, mx.array]:
        return self._coded_groups(pages, 3, sdt)

    def _values(self, p: dict[str, mx.array], part: str, bits: int, n: int) -> mx.array:
        s, z = self._params(p, part)
        c = unpack(p[part], bits, s.shape[-1]).astype(mx.float32)
        return c * s + z

    @staticmethod
    def _params(p: dict[str, mx.array], part: str) -> tuple[mx.array, mx.array]:
        """A group's per-channel scale and minimum, float32 ``(B, H, P, 1, D)``."""
        s = p[f"{part}_scale"].astype(mx.float32)[:, :, :, None]
        return s, p[f"{part}_zero"].astype(mx.float32)[:, :, :, None]

    def _part_scores(self, q: mx.array, p: dict[str, mx.array], name: str, bits: int):
        # q . (s * c + z) = (q * s) . c + q . z, per block
        s, z = self._params(p, name)
        qs = q * s
        return codes_matmul(qs, p[name], bits, s.shape[-1], True) + mx.sum(
            q * z, axis=-1, keepdims=True
        )

    def _part_mix(self, w: mx.array, p: dict[str, mx.array], name: str, bits: int):
        # sum_t w_t (s * c_t + z) = (w @ c) * s + (sum_t w_t) * z, per block
        s, z = self._params(p, name)
        wc = codes_matmul(w, p[name], bits, s.shape[-1], False)
        return wc * s + mx.sum(w, axis=-1, keepdims=True) * z


class MixedSeparable(MixedBlocks):
    """Channel-separable tokenwise codes in blocks (ZipCache's values): per block and KV head,
    each channel divided by ``sqrt(max |x|)`` over the block's tokens, then each token coded
    over its channels with its own scale and minimum. Parameters: see the module and
    :class:`~velox_zipcache.blocks.MixedBlocks`."""

    name = "zipcache-separable"

    def _code(self, pages: mx.array, sdt: mx.Dtype) -> dict[str, mx.array]:
        chan = mx.sqrt(mx.max(mx.abs(pages), axis=3, keepdims=True)).astype(sdt)
        c = chan.astype(mx.float32)
        x = mx.where(c > 0, pages / mx.maximum(c, 1e-30), 0.0)  # a zero channel stays zero
        return {"chan": chan.squeeze(3), **self._coded_groups(x, 4, sdt)}

    def _values(self, p: dict[str, mx.array], part: str, bits: int, n: int) -> mx.array:
        s = p[f"{part}_scale"].astype(mx.float32)[..., None]
        z = p[f"{part}_zero"].astype(mx.float32)[..., None]
        c = unpack(p[part], bits, p["chan"].shape[-1]).astype(mx.float32)
        return c * s + z

    def _finish(self, x: mx.array, p: dict[str, mx.array]) -> mx.array:
        return x * p["chan"].astype(mx.float32)[:, :, :, None]

    def _part_scores(self, q: mx.array, p: dict[str, mx.array], name: str, bits: int):
        # q . (c (.) x_hat) = (q (.) c) . x_hat, c the block's channel scales
        qc = q * p["chan"].astype(mx.float32)[:, :, :, None]
        d = p["chan"].shape[-1]
        return codes_matmul(qc, p[name], bits, d, True, p[f"{name}_scale"], p[f"{name}_zero"])

    def _part_mix(self, w: mx.array, p: dict[str, mx.array], name: str, bits: int):
        d = p["chan"].shape[-1]
        return codes_matmul(w, p[name], bits, d, False, p[f"{name}_scale"], p[f"{name}_zero"])

    def _finish_mix(self, out: mx.array, p: dict[str, mx.array]) -> mx.array:
        return out * p["chan"].astype(mx.float32)[:, :, :, None]
