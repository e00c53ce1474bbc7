"""``KittyKeys``: per-channel key codes in pages, the top channels of each page boosted.

Kitty (arXiv 2511.18643, "Dynamic Channel-wise Precision Boost") quantizes keys per channel,
asymmetric (a scale and a minimum per channel), over pages of ``group`` tokens (128 in the
paper). In each page and each KV head the channels are ranked by a score computed from that
page's own tokens, and the ``k = int(D * boost)`` channels scoring highest are coded at
``boost_bits`` (4), the others at ``bits`` (2). The paper's system ranks by magnitude (the
mean of ``|k|`` over the page's tokens); its simulator also offers the variance over the
page's tokens (``score="variance"``).

Storage (Kitty's decomposition of a mixed-precision page into uniform parts): the low
``bits`` bits of every channel's code, bit-packed per token (``codes``); the upper
``boost_bits - bits`` bits of the boosted channels only, in ascending channel order
(``boost_codes``); per page the boosted channel indices (``boost_idx``, uint8, ``k`` of them)
and each channel's fp16 scale and minimum (``scale``, ``zero``). A code is
``low + (upper << bits)``; a value ``scale * code + zero``.

Attention reads the codes: the per-page scales are folded into the query,
``q . (s * c + z) = (q * s) . c + q . z``, and the value weights are summed per page against
the zeros, as for any per-channel affine code.
"""

from __future__ import annotations

import mlx.core as mx

from velox_core import Codec, Packed
from velox_core.codec.uniform import channel_group_mix, channel_group_scores
from velox_core.ops import pack, scale_dtype, unpack
from velox_core.validation import check_bits, check_choice, check_float, check_int

__all__ = ["SCORES", "KittyKeys", "boosted_count"]

# how the channels of a page are ranked: mean |k| (the paper's system) or the variance
SCORES = ("magnitude", "variance")

_MIN_SCALE = 1e-8


def boosted_count(dim: int, boost: float) -> int:
    """Channels boosted per page and head: ``int(dim * boost)`` (the paper's rule, with a
    small epsilon so that ``0.25 * 128`` is 32 and not 31 under rounding)."""
    return max(0, min(dim, int(dim * boost + 1e-6)))


class KittyKeys(Codec):
    """Kitty's key codec.

    Args:
        bits: code width of the channels that are not boosted (the paper: 2).
        boost_bits: code width of the boosted channels (the paper: 4), above ``bits``.
        boost: fraction of each page's channels that are boosted, in ``[0, 1]``.
        group: tokens per page; each channel of a page has one scale and minimum.
        score: ``"magnitude"`` (mean ``|k|`` over the page's tokens) or ``"variance"``.

    Packed layout (``k`` boosted channels, head dim ``D``): per token ``codes`` uint32
    ``(ceil(D*bits/32),)`` and ``boost_codes`` uint32 ``(ceil(k*(boost_bits-bits)/32),)``;
    per page ``boost_idx`` uint8 ``(k,)``, ``scale`` and ``zero`` fp16 ``(D,)``. With
    ``k = 0`` there is no ``boost_codes`` nor ``boost_idx``.
    """

    name = "kitty-key"
    settings = ("bits", "boost_bits", "boost", "group", "score")
    compressed_scores = True
    compressed_mix = True

    def __init__(
        self,
        bits: int = 2,
        boost_bits: int = 4,
        boost: float = 0.25,
        group: int = 128,
        score: str = "magnitude",
    ):
        self.bits = check_bits("bits", bits, minimum=1, maximum=7)
        self.boost_bits = check_bits("boost_bits", boost_bits, minimum=bits + 1, maximum=8)
        self.boost = check_float("boost", boost, minimum=0.0, maximum=1.0)
        self.group = check_int("group", group, minimum=1)
        self.score = check_choice("score", score, SCORES)
        self.block = self.group

    def check(self, dim: int, dtype: mx.Dtype) -> None:
        if dim > 256:
            raise ValueError(f"kitty: head dim {dim} exceeds 256 (channel indices are uint8)")

    # -- the allocation rule ----------------------------------------------------------------
    def channel_scores(self, pages: mx.array) -> mx.array:
        """Each channel's score over a page's tokens.

        Shapes:
            pages float32 ``(B, H, P, group, D)``; returns float32 ``(B, H, P, D)``.
        """
        if self.score == "magnitude":
            return mx.mean(mx.abs(pages), axis=3)
        mean = mx.mean(pages, axis=3, keepdims=True)
        return mx.mean(mx.square(pages - mean), axis=3)

    def boosted(self, pages: mx.array) -> mx.array:
        """The boosted channels of each page, ascending: the ``k`` highest scores.

        Shapes:
            pages float32 ``(B, H, P, group, D)``; returns int32 ``(B, H, P, k)``.
        """
        d = pages.shape[-1]
        k = boosted_count(d, self.boost)
        order = mx.argsort(-self.channel_scores(pages), axis=-1)[..., :k]
        return mx.sort(order, axis=-1).astype(mx.int32)

    # -- coding ------------------------------------------------------------------------------
    def encode(self, x: mx.array, positions: mx.array | None = None) -> Packed:
        b, h, t, d = x.shape
        g, up = self.group, self.boost_bits - self.bits
        pages = x.astype(mx.float32).reshape(b, h, t // g, g, d)
        k = boosted_count(d, self.boost)
        lo = mx.min(pages, axis=3, keepdims=True)
        hi = mx.max(pages, axis=3, keepdims=True)
        levels = mx.full((b, h, t // g, 1, d), (1 << self.bits) - 1, dtype=mx.float32)
        data: dict[str, mx.array] = {}
        if k:
            idx = self.boosted(pages)  # (B, H, P, k)
            mask = mx.any(mx.arange(d)[:, None] == idx[..., None, :], axis=-1)  # (B, H, P, D)
            levels = mx.where(mask[:, :, :, None], (1 << self.boost_bits) - 1, levels)
        sdt = scale_dtype(x.dtype)
        scale = mx.maximum((hi - lo) / levels, _MIN_SCALE).astype(sdt)
        zero = lo.astype(sdt)
        # quantize against the stored (rounded) scale and zero so decode matches exactly
        q = mx.round((pages - zero.astype(mx.float32)) / scale.astype(mx.float32))
        codes = mx.clip(q, 0, levels).astype(mx.uint8)  # (B, H, P, g, D)
        data["codes"] = pack(codes.reshape(b, h, t, d) & ((1 << self.bits) - 1), self.bits)
        if k:
            gather = mx.broadcast_to(idx[:, :, :, None, :], (b, h, t // g, g, k))
            upper = mx.take_along_axis(codes, gather, axis=-1) >> self.bits
            data["boost_codes"] = pack(upper.reshape(b, h, t, k), up)
            data["boost_idx"] = idx.astype(mx.uint8)
        data["scale"] = scale.squeeze(3)
        data["zero"] = zero.squeeze(3)
        per_block = frozenset({"scale", "zero", "boost_idx"} & set(data))
        return Packed(data, t, g, per_block)

    def codes(self, packed: Packed) -> mx.array:
        """The integer codes of a record, low and upper bits joined.

        Shapes:
            returns float32 ``(B, H, P, group, D)``.
        """
        p = packed.data
        b, h, t = p["codes"].shape[:3]
        d, g = p["scale"].shape[-1], self.group
        c = unpack(p["codes"], self.bits, d).astype(mx.float32).reshape(b, h, t // g, g, d)
        if "boost_idx" in p:
            idx = p["boost_idx"].astype(mx.int32)  # (B, H, P, k)
            k = idx.shape[-1]
            upper = unpack(p["boost_codes"], self.boost_bits - self.bits, k)
            upper = upper.astype(mx.float32).reshape(b, h, t // g, g, k)
            gather = mx.broadcast_to(idx[:, :, :, None, :], upper.shape)
            full = mx.put_along_axis(mx.zeros_like(c), gather, upper, axis=-1)
            c = c + full * float(1 << self.bits)
        return c

    def _pages(self, packed: Packed) -> tuple[mx.array, mx.array, mx.array]:
        """Codes float32 ``(B, H, P, g, D)``, scale and zero float32 ``(B, H, P, 1, D)``."""
        p = packed.data
        s = p["scale"].astype(mx.float32)[:, :, :, None, :]
        z = p["zero"].astype(mx.float32)[:, :, :, None, :]
        return self.codes(packed), s, z

    def decode(self, packed: Packed) -> mx.array:
        c, s, z = self._pages(packed)
        b, h, pg, g, d = c.shape
        return (c * s + z).reshape(b, h, pg * g, d)

    def scores(self, q: mx.array, packed: Packed) -> mx.array:
        # fold each page's per-channel scales into the query; the zeros add q . z per page
        return channel_group_scores(q, *self._pages(packed))

    def mix(self, w: mx.array, packed: Packed) -> mx.array:
        # per page: (w @ codes) * scale + (sum of w) * zero, summed over the pages
        return channel_group_mix(w, *self._pages(packed))
