"""The coded tiers of :class:`~velox_core.VeloxCache`: tokens into and out of the codes.

A :class:`Tier` is one coded segment's key and value codecs and span. :class:`TierMixin`
moves tokens along the segments (sinks | tier n-1 ... tier 0 | window): window overflow
encoded into tier 0 once it reaches the flush quantum (or a prefill's whole blocks straight
into tier 0, with ``window=0``), a tier's overflow decoded and re-encoded into the next tier,
the stored segments listed in temporal order, and trims that cut the newest tokens back
through the window and the tiers (decoding a split block back into the window).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import mlx.core as mx

from ..codec.base import Codec, Packed
from ..codec.identity import Identity
from ..kernels.disk_cache import compiled_together
from ..validation import check_int
from .attention import Segment
from .retention import RetentionMixin
from .store import PackedStore

__all__: list[str] = []


_PLAIN: dict[type, bool] = {}


def plain_tiers(cls: type) -> bool:
    """Whether ``cls`` stores, flushes and lists its coded tokens as velox-core's mixins do:
    a subclass that overrides any of it (cross-layer caches list joined segments, XQuant
    stores a pair's codes once, ZipCache re-codes at its flush) takes the general paths."""
    plain = _PLAIN.get(cls)
    if plain is None:
        plain = _PLAIN[cls] = (
            cls.before_coding is TierMixin.before_coding
            and cls._flush is TierMixin._flush
            and cls.segments is TierMixin.segments
            and cls._append_body is RetentionMixin._append_body
        )
    return plain


@dataclass
class Tier:
    """A coded segment: its key and value codecs and how many tokens it holds at most."""

    key_codec: Codec
    value_codec: Codec
    span: int | None = None

    def fresh(self) -> Tier:
        return Tier(self.key_codec.fresh(), self.value_codec.fresh(), self.span)


class TierMixin:
    """The coded tiers of a VeloxCache: flushing, segments, trimming (mixed in; uses its
    stores ``_sink``, ``_tier``, ``_win``, its ``tiers`` and the retention mixin's ``_pos``)."""

    def _direct(self) -> bool:
        """Whether new tokens go straight into tier 0 (no window, nothing waiting in it, and
        no calibration hook): the same records as passing through the window, without
        storing them there first."""
        return (
            self.window == 0
            and self.stored.window[0].tokens == 0
            and type(self).before_coding is TierMixin.before_coding
        )

    def _encode_direct(self, keys: mx.array, values: mx.array, pos0: int) -> int:
        """Encode the whole codec blocks of ``keys``/``values`` (absolute positions from
        ``pos0``) into tier 0; returns how many tokens that took (the rest, less than a
        block, waits in the window)."""
        first = self.tiers[0]
        block = _lcm(first.key_codec.block, first.value_codec.block)
        t = keys.shape[2]
        n = t // block * block
        if n == 0:
            return 0
        if n < t:
            keys, values = keys[:, :, :n], values[:, :, :n]
        pos = mx.arange(pos0, pos0 + n, dtype=mx.int32)
        with compiled_together():  # the encodes' new kernel variants, and the probe beside them
            self._append_body(
                first.key_codec.encode(keys, pos), first.value_codec.encode(values, pos), pos
            )
            self._planned.probe_ahead(self)
        return n

    def _write_direct(self, keys: mx.array, values: mx.array) -> bool:
        """A decode step's fast path where every token is coded on arrival (``window=0``,
        one tier, codec blocks of ``flush`` tokens, no policy, sinks full, tier 0 holding
        tokens already): the step's tokens encoded and written into tier 0's buffers in place,
        as the general path's direct write, without its checks. Returns False where the
        general path must run.

        A buffer's growth runs before the write and is evaluated on its own
        (``mx.async_eval``), so that every step's graph is the same encode and write."""
        st = self.stored
        if (
            self.window
            or len(self.tiers) != 1
            or self.policy is not None
            or st.positions is not None
            or st.heads is not None
            or st.dims is None
            or st.window[0].tokens
            or st.sink[0].tokens < self.sinks
            or not plain_tiers(type(self))
            or not isinstance(keys, mx.array)
            or not isinstance(values, mx.array)
            or keys.ndim != 4
            or values.ndim != 4
            or keys.dtype != st.dtype
            or values.dtype != st.dtype
        ):
            return False
        ks, vs = st.coded[0]
        (b, h, t, dk), (vb, vh, vt, dv) = keys.shape, values.shape
        if (
            ks.buf is None
            or (b, h, dk, dv) != st.dims
            or (vb, vh, vt) != (b, h, t)
            or t > self.fused_above
            or t % self._flush_at
            or t == 0
        ):
            return False
        first = self.tiers[0]
        pos = mx.arange(self.offset, self.offset + t, dtype=mx.int32)  # lazy: built if read
        kp, vp = first.key_codec.encode(keys, pos), first.value_codec.encode(values, pos)
        if ks.tokens + t > ks.capacity:
            ks.reserve(ks.tokens + t)
            vs.reserve(vs.tokens + t)
            mx.async_eval(ks.arrays() + vs.arrays())
        self._planned.clear()  # the coded segment changes: its decode plan with it
        ks.put(kp)
        vs.put(vp)
        self.offset += t
        return True

    def one_segment(self) -> Segment | None:
        """The only segment where tier 0 holds every stored token (one tier, no sinks or
        window tokens, no per-head budgets, core's own tier hooks): :meth:`segments` without
        listing them, for a decode step; None otherwise."""
        st = self.stored
        if (
            len(self.tiers) != 1
            or st.heads is not None
            or st.sink[0].tokens + st.window[0].tokens
            or not plain_tiers(type(self))
        ):
            return None
        k = st.coded[0][0].view()
        if k is None:
            return None
        t = self.tiers[0]
        return Segment(t.key_codec, k, t.value_codec, st.coded[0][1].view())

    def _decoded_tier(self) -> tuple[mx.array, mx.array] | None:
        """Every stored token decoded where :meth:`one_segment` holds them all
        (:meth:`keys_and_values` without listing the segments); None otherwise."""
        seg = self.one_segment()
        if seg is None:
            return None
        dtype = self._io_dtype
        return seg.key_codec.decode_as(seg.keys, dtype), seg.value_codec.decode_as(
            seg.values, dtype
        )

    def before_coding(self) -> bool:
        """Hook run on every update before window overflow moves into the coded tiers.

        Methods that fit their codecs on stored tokens (calibration) override it: fit from
        the window when it holds enough tokens and return True, or return False to keep every
        token in the window for now (nothing moves this update). The default moves at once.
        """
        return True

    def _quantum(self) -> int:
        """Tokens the window passes to tier 0 at once: ``flush`` in whole codec blocks (and
        sets ``_codec_block``, tier 0's codec block in tokens)."""
        first = self.tiers[0]
        self._codec_block = _lcm(first.key_codec.block, first.value_codec.block)
        return _lcm(self.flush, self._codec_block)

    def _flush_count(self, tokens: int) -> int:
        """Tokens a window holding ``tokens`` passes to tier 0: the whole codec blocks past
        what it keeps, once they reach the flush quantum (else 0)."""
        over = tokens - self._keep
        return over // self._codec_block * self._codec_block if over >= self._flush_at else 0

    def _flush(self, ahead: int = 0) -> None:
        """Move window overflow into tier 0 (once it reaches the flush quantum) and tier
        overflow down the tiers; tier 0's new codes get their kernel sides for the decode
        attention then (:meth:`~velox_core.cache.planned.PlannedAttention.refresh`).
        ``ahead``: tokens about to be written into the window, counted as if they were there
        (the caller checks that the tokens passed on are all stored already)."""
        if not self.before_coding():
            return
        first = self.tiers[0]
        n = self._flush_count(self.stored.window[0].tokens + ahead)
        if n > 0:
            pos0 = self.offset - self.stored.window[0].tokens
            pos = mx.arange(pos0, pos0 + n, dtype=mx.int32)
            wk, wv = self.stored.window[0].view(), self.stored.window[1].view()
            with compiled_together():  # as in _encode_direct
                self._append_body(
                    first.key_codec.encode(wk.slice(0, n).data["x"], pos),
                    first.value_codec.encode(wv.slice(0, n).data["x"], pos),
                    pos,
                )
                self._planned.probe_ahead(self)
            self.stored.window[0].drop_front(n)
            self.stored.window[1].drop_front(n)
            self._planned.refresh(self)  # the new segment's kernel sides, made with its codes
        for i in range(len(self.tiers) - 1):
            src, dst = self.tiers[i], self.tiers[i + 1]
            blk = _lcm(
                _lcm(src.key_codec.block, src.value_codec.block),
                _lcm(dst.key_codec.block, dst.value_codec.block),
            )
            over = self.stored.coded[i][0].tokens - src.span
            n = over // blk * blk
            if n <= 0:
                continue
            kp = self.stored.coded[i][0].view().slice(0, n)
            vp = self.stored.coded[i][1].view().slice(0, n)
            pos0 = self._body_start(i)
            pos = mx.arange(pos0, pos0 + n, dtype=mx.int32)
            k = src.key_codec.decode(kp).astype(self.stored.dtype)
            v = src.value_codec.decode(vp).astype(self.stored.dtype)
            with compiled_together():
                self.stored.coded[i + 1][0].append(dst.key_codec.encode(k, pos))
                self.stored.coded[i + 1][1].append(dst.value_codec.encode(v, pos))
            self.stored.coded[i][0].drop_front(n)
            self.stored.coded[i][1].drop_front(n)

    def _body_start(self, i: int) -> int:
        """Absolute position of the oldest token of tier ``i`` (no eviction assumed)."""
        after = self.stored.window[0].tokens + sum(
            self.stored.coded[j][0].tokens for j in range(i + 1)
        )
        return self.offset - after

    def segments(self) -> list[Segment]:
        """Stored tokens in temporal order, as (codec, record) pairs for keys and values."""
        if self.ragged:
            raise ValueError("per-head budgets: segments differ by head (see _head_segments)")
        out = []
        pairs = [(self.stored.sink, self._ident, self._ident)]
        pairs += [
            (self.stored.coded[i], t.key_codec, t.value_codec)
            for i, t in reversed(list(enumerate(self.tiers)))
        ]
        pairs += [(self.stored.window, self._ident, self._ident)]
        for (ks, vs), kc, vc in pairs:
            k = ks.view()
            if k is not None:
                out.append(Segment(kc, k, vc, vs.view()))
        return out

    def is_trimmable(self) -> bool:
        """Whether :meth:`trim` leaves exactly the cache that never stored the trimmed tokens,
        for any count (mlx-lm asks before speculative decoding and before reusing a longer
        prompt cache; False makes it refuse or prefill instead).

        True when nothing is evicted (no retention policy), no codec is fitted on the stored
        tokens (``before_coding``), and every token is either kept as given (no codec) or
        coded alone the moment it arrives: one tier, ``window=0``,
        ``flush=1`` and codecs of one token a block (``uniform:bits=4,flush=1``, say).
        Otherwise a trim past the fp16 tokens would decode coded tokens back into the window,
        which the cache that never saw the trimmed tokens would hold as given; :meth:`trim`
        still does that when called.
        """
        if self.policy is not None or self.ragged:
            return False
        if type(self).before_coding is not TierMixin.before_coding:
            return False  # codecs fitted on the stored tokens: a trim cannot undo a fit
        t = self.tiers[0]
        if all(isinstance(c, Identity) for x in self.tiers for c in (x.key_codec, x.value_codec)):
            return True  # nothing is coded: every token stays as given
        return (
            len(self.tiers) == 1
            and self.window == 0
            and self.flush == 1
            and t.key_codec.block == 1
            and t.value_codec.block == 1
        )

    def reuses_prefix(self) -> bool:
        """Whether :meth:`trim` leaves the tokens it keeps as this cache holds them, so that a
        prompt cache may reuse a longer entry's prefix (``velox serve`` does).

        True where :meth:`is_trimmable` is, and also where only the window and flush rules
        stop it: no retention policy, no per-head budgets, no codec fitted on the stored
        tokens and no method's own trim rule. There the kept tokens stay coded, and a coded
        block the trim splits is decoded back into the window: they carry their codes'
        rounding, where a cache that never stored the trimmed tokens would hold up to
        ``window + flush`` of them as given.
        """
        if self.is_trimmable():
            return True
        if type(self).is_trimmable is not TierMixin.is_trimmable:
            return False  # a method's own rule (linked layers, fitted state)
        fitted = type(self).before_coding is not TierMixin.before_coding
        return self.policy is None and not self.ragged and not fitted

    def trim(self, n: int) -> int:
        """Remove the last ``n`` tokens; returns ``n``.

        Raises ``ValueError`` when ``n`` exceeds the stored tokens (or is negative).
        """
        self._planned.clear()
        check_int("n", n, minimum=0)
        if n > self.size():
            raise ValueError(f"cannot trim {n} tokens: the cache stores {self.size()}")
        if self.ragged and n > self.stored.window[0].tokens:
            raise ValueError(
                f"cannot trim {n} tokens: with per-head budgets only the "
                f"{self.stored.n_window} window tokens can be trimmed"
            )
        left = n
        left = trim_stores(self.stored.window, left)
        for i in range(len(self.tiers)):
            if left == 0:
                break
            left = self._trim_tier(i, left)
        if left:
            trim_stores(self.stored.sink, left)
        self.offset -= n
        return n

    def _trim_tier(self, i: int, n: int) -> int:
        ks, vs = self.stored.coded[i]
        if n >= ks.tokens:
            rest = n - ks.tokens
            ks.truncate(0), vs.truncate(0)
            if i == 0 and self.stored.positions is not None:
                self.stored.positions.truncate(0)
            return rest
        t = self.tiers[i]
        block = _lcm(t.key_codec.block, t.value_codec.block)
        keep = ks.tokens - n
        cut = keep // block * block
        if cut != keep:
            # a block is split: decode its surviving tokens back into the window
            k = t.key_codec.decode(ks.view().slice(cut, cut + block)).astype(self.stored.dtype)
            v = t.value_codec.decode(vs.view().slice(cut, cut + block)).astype(self.stored.dtype)
            ks.truncate(cut), vs.truncate(cut)
            win_k, win_v = self.stored.window[0].view(), self.stored.window[1].view()
            self.stored.window[0].replace(
                Packed.concat([self._ident.encode(k[:, :, : keep - cut]), win_k])
            )
            self.stored.window[1].replace(
                Packed.concat([self._ident.encode(v[:, :, : keep - cut]), win_v])
            )
        else:
            ks.truncate(keep), vs.truncate(keep)
        if i == 0 and self.stored.positions is not None:
            self.stored.positions.truncate(ks.tokens)
        return 0


def _lcm(a: int, b: int) -> int:
    return a * b // math.gcd(a, b)


def trim_stores(pair: tuple[PackedStore, PackedStore], n: int) -> int:
    """Drop up to ``n`` of the newest tokens of a (keys, values) store pair; returns how many
    of the ``n`` are left to drop from older segments."""
    k, v = pair
    take = min(n, k.tokens)
    k.truncate(k.tokens - take), v.truncate(v.tokens - take)
    return n - take
