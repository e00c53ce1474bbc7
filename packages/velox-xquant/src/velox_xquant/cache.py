"""``XQuantCache``: one layer of XQuant (arXiv 2510.11236), KIVI-style calibrated codes, in
pairs of layers that share them.

Every layer codes its keys per channel (groups of ``group`` tokens) and its values per token
(groups of ``group`` channels) at ``key_bits`` / ``value_bits`` (1 to 8), with XQuant's
data-free calibration of the zero-points and scales (:class:`~velox_xquant.codec.XQuantCodes`).
``velox_core.make_cache(model, "xquant:...")`` then calls :meth:`XQuantCache.link_layers`,
which pairs each odd layer ``l >= share_from`` with layer ``l - 1`` under one
:class:`~velox_xquant.pair.XQuantPair`: the higher layer stores no codes for the shared sides
(``share``), only its own scales and zero-points, and reads the lower layer's codes. A cache
made alone, and every layer outside a pair, codes its own.

Attention reads the codes through velox-core's affine layouts: the lower layer's codes with
this layer's scales make one ``Uniform`` record (keys ``ChannelAffineCodes``, values
``AffineCodes``), which ``mx.quantized_matmul`` (2 to 6 and 8-bit values in groups of 32, 64
or 128), the fused decode kernels (GPU) or the tiled reference path read; no fp16 copy of the
stored tokens is made.

Deviations from the reference code (also in docs/xquant.md): keys and values leave the fp16
window together, 64 tokens at a time (the reference quantizes its keys 128 at a time and
streams values out of a 128-token residual); the first ``sinks`` tokens may stay in fp16;
mlx-lm's batching of separately made caches (``merge``, ``extend``, ``filter``) is refused for
a pair's layers, which share their codes (a batch prefilled together works, and a cache with
``share_from=None`` batches like any velox cache); a pair's layers are not trimmable.
"""

from __future__ import annotations

import math
from typing import Any

import mlx.core as mx

from velox_core import Codec, Packed, VeloxCache
from velox_core.cache.attention import Segment
from velox_core.cache.linked import LinkedLayers
from velox_core.cache.planned import PlannedAttention
from velox_core.cache.tiers import trim_stores

from .codec import XQuantCodes, XQuantScales, default_eta
from .config import XQuantConfig
from .pair import XQuantPair

__all__ = ["XQuantCache"]

_SIDES = ((0, "k", "key"), (1, "v", "value"))


class _Unplanned(PlannedAttention):
    """A pair's layer attends through its joined segments (the planned path reads the coded
    tier's own records, which lack the shared codes)."""

    __slots__ = ()

    def __call__(self, cache: Any, queries: mx.array, scale: float) -> None:
        return None


class XQuantCache(LinkedLayers):
    """XQuant's cache for one layer. Parameters: see :class:`XQuantConfig`."""

    method = "xquant"
    Config = XQuantConfig
    Group = XQuantPair
    no_flush = "both layers of a pair pass their tokens on together, a key group at a time"
    batch_hint = (
        "prefill equal-length sequences together as one batch instead, or use share_from=None "
        "(no layer pairs) to batch like any velox cache"
    )

    def __init__(self, **params: Any):
        self.shared = ""  # the sides this layer keeps in its pair's code stores
        self._fresh = True  # made by make_cache (link_layers may pair it), not loaded
        super().__init__(**params)

    def make_codecs(self, cfg: XQuantConfig, kb: int, vb: int) -> tuple[Codec, Codec]:
        ek = default_eta(kb) if cfg.eta is None else cfg.eta
        ev = default_eta(vb) if cfg.eta is None else cfg.eta
        keys = XQuantCodes(kb, cfg.group, axis="channel", eta=ek)
        values = XQuantCodes(vb, cfg.group, axis="token", eta=ev)
        return keys, values

    def describe(self) -> str:
        t, c = self.tiers[0], self.cfg
        if self.group is None or not self.shared:
            where = "codes its own"
        elif self.group.owner is self:
            where = f"writes the codes of '{self.shared}' for its pair {self.group.layers}"
        else:
            where = f"reads '{self.shared}' codes of its pair {self.group.layers}"
        return (
            f"xquant: K={t.key_codec.describe()} V={t.value_codec.describe()} "
            f"window={c.window} sinks={c.sinks} share_from={c.share_from} ({where})"
        )

    # -- pairing ------------------------------------------------------------------------------
    def _link(self, sides: str) -> None:
        """Share ``sides`` with the pair: their codecs store scales only (``XQuantScales``)."""
        self.shared = sides
        t = self.tiers[0]
        for _, side, word in _SIDES:
            codec = getattr(t, f"{word}_codec")
            cls = XQuantScales if side in sides else XQuantCodes
            if type(codec) is not cls:
                setattr(t, f"{word}_codec", cls(**codec.config()))
        self._planned = _Unplanned() if sides else PlannedAttention()

    @classmethod
    def group_fresh(cls, caches: list) -> None:
        """Pair each fresh odd layer ``l >= share_from`` with layer ``l - 1``; a layer whose
        lower neighbour keeps the model's own cache (a sliding-window layer, say) codes its own,
        one whose lower neighbour has another velox cache is refused."""

        def fresh(c: Any) -> bool:
            return (
                isinstance(c, XQuantCache)
                and c._saved is None
                and c._fresh
                and (c.group is None and c.stored.dims is None)
            )

        for i in range(1, len(caches), 2):
            up, low = caches[i], caches[i - 1]
            if not fresh(up):
                continue
            up.layer = i if up.layer is None else up.layer
            sides = up.cfg.shares(up.layer)
            if not sides:
                continue
            if not isinstance(low, VeloxCache):
                continue  # the model keeps its own cache there (a sliding-window layer)
            if not isinstance(low, XQuantCache):
                raise ValueError(
                    f"xquant: layer {i} reads layer {i - 1}'s codes (share_from="
                    f"{up.cfg.share_from}), whose cache is {type(low).__name__}; both layers of "
                    "a pair need XQuant caches (or set share_from past this layer)"
                )
            if not fresh(low):
                continue
            low.layer = i - 1 if low.layer is None else low.layer
            _check_pair(low, up, sides)
            low._link(sides)
            up._link(sides)
            XQuantPair([low, up])

    # -- coding: the shared codes go to the pair ------------------------------------------------
    def _append_body(self, kp: Packed, vp: Packed, positions: mx.array) -> None:
        if self.group is not None and self.shared:
            for i, rec in ((0, kp), (1, vp)):
                self._put_codes(i, rec)
        super()._append_body(kp, vp, positions)

    def _put_codes(self, i: int, rec: Packed) -> None:
        """The codes of a shared side's new record (its codec's ``pending``): the pair's writer
        appends them to the pair's store, the other layer checks that they are there."""
        side, word = "kv"[i], ("key", "value")[i]
        if side not in self.shared:
            return
        codec = getattr(self.tiers[0], f"{word}_codec")
        codes, codec.pending = codec.pending, None
        if codes is None or codes.shape[2] != rec.tokens:
            raise ValueError(
                f"xquant: layer {self.layer}'s {word} codes of this record are missing"
            )
        store, mine = self.group.codes[i], self.stored.coded[0][i].tokens
        if self.group.owner is self:
            if store.tokens > mine:  # codes the other layer no longer uses (after trims)
                store.truncate(mine)
            if store.tokens != mine:
                raise ValueError(
                    f"xquant: layer {self.layer}'s pair holds {store.tokens} coded tokens, this "
                    f"layer {mine}: trim both layers of a pair by the same count"
                )
            store.append(Packed({"codes": codes}, rec.tokens, rec.block))
        elif store.tokens < mine + rec.tokens:
            raise ValueError(
                f"xquant: layer {self.layer} reads its pair's codes of tokens {mine} to "
                f"{mine + rec.tokens - 1}, which layer {self.group.owner.layer} has not coded "
                f"(it holds {store.tokens}): a pair's layers take the same tokens, the lower "
                "layer first (run the model's layers in order)"
            )

    def _joined(self, i: int, rec: Packed) -> Packed:
        """A coded record of this layer with the pair's codes of its tokens."""
        if "codes" in rec.data:
            return rec
        codes = self.group.codes[i].view()
        held = 0 if codes is None else codes.tokens
        if held < rec.tokens:
            raise ValueError(
                f"xquant: layer {self.layer} uses {rec.tokens} coded tokens of its pair, which "
                f"holds {held}: load the whole model's caches with velox_core.load_cache, "
                "and trim both layers of a pair by the same count"
            )
        if held > rec.tokens:
            codes = codes.slice(0, rec.tokens)
        data = {"codes": codes.data["codes"], **rec.data}
        return Packed(data, rec.tokens, rec.block, rec.per_block)

    def segments(self) -> list[Segment]:
        """Sinks, the coded tokens (the pair's codes joined to this layer's scales), window."""
        if self.group is None or not self.shared:
            return super().segments()
        t = self.tiers[0]
        out = []
        for stores, coded in (
            (self.stored.sink, False),
            (self.stored.coded[0], True),
            (self.stored.window, False),
        ):
            k = stores[0].view()
            if k is None:
                continue
            v = stores[1].view()
            if coded:
                k, v = self._joined(0, k), self._joined(1, v)
                out.append(Segment(t.key_codec, k, t.value_codec, v))
            else:
                out.append(Segment(self._ident, k, self._ident, v))
        return out

    # -- trim (not exact: is_trimmable() is False for a pair's layers) --------------------------
    def _trim_shared(self, n: int) -> None:
        """Remove the newest ``n`` coded tokens (then sinks): a key group cut in two is
        decoded back into the window, as an unpaired cache does."""
        ks, vs = self.stored.coded[0]
        coded = ks.tokens
        if n >= coded:
            ks.truncate(0), vs.truncate(0)
            trim_stores(self.stored.sink, n - coded)
        else:
            t = self.tiers[0]
            block = math.lcm(t.key_codec.block, t.value_codec.block)
            keep = coded - n
            cut = keep // block * block
            if cut != keep:
                kr = self._joined(0, ks.view()).slice(cut, cut + block)
                vr = self._joined(1, vs.view()).slice(cut, cut + block)
                k = t.key_codec.decode(kr).astype(self.stored.dtype)[:, :, : keep - cut]
                v = t.value_codec.decode(vr).astype(self.stored.dtype)[:, :, : keep - cut]
                for store, x in ((self.stored.window[0], k), (self.stored.window[1], v)):
                    rest = store.view()
                    store.replace(Packed.concat([self._ident.encode(x), rest]))
            ks.truncate(cut), vs.truncate(cut)
        self.group.shrink()

    # -- state: the layer's shared sides ---------------------------------------------------------
    def _record(self, info: dict, arrays: dict) -> None:
        info["shared"] = self.shared

    def _restore(self, info: dict, arrays: dict) -> None:
        self._fresh = False
        shared = info.get("shared", "")
        if shared not in ("", "kv", "k", "v"):
            raise ValueError(f"xquant: the file's shared sides {shared!r} are not '', kv, k or v")
        self._link(shared if self.group is not None else "")


def _check_pair(low: XQuantCache, up: XQuantCache, sides: str) -> None:
    """Both layers of a pair code the shared sides alike and pass tokens on together."""
    why = []
    for field in ("group", "window", "sinks"):
        a, b = getattr(low.cfg, field), getattr(up.cfg, field)
        if a != b:
            why.append(f"{field} {a} / {b}")
    for _, side, word in _SIDES:
        if side not in sides:
            continue
        a, b = (getattr(c.tiers[0], f"{word}_codec") for c in (low, up))
        if (a.bits, a.group) != (b.bits, b.group):
            why.append(
                f"{word} codes of {a.bits} / {b.bits} bits in groups of {a.group} / {b.group}"
            )
    if why:
        raise ValueError(
            f"xquant: layers {low.layer} and {up.layer} form a pair sharing '{sides}' codes but "
            f"differ: {'; '.join(why)} (a pair needs the same widths, groups, window and sinks)"
        )
