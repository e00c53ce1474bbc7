"""``ZipCacheCache``: per-token precision from normalized-attention saliency (ZipCache, arXiv
2405.14256).

New tokens enter the fp16 window. The attention call that follows their update (the model's
own queries, which reach the cache through ``velox_core.routed``) scores them: a multi-token
call (a prefill chunk) scores every unscored window token from its probe queries
(:mod:`velox_zipcache.saliency`); a decode step scores the unscored tokens of the window's
whole blocks past ``window`` with its one query, so decode tokens are scored once a block of
``group`` is complete (the authors' streaming interval). The next update codes the scored
tokens past ``window`` a block at a time: in each block and KV head the ``salient`` share of
its tokens with the highest scores at ``bits`` and the rest at ``low_bits``
(:mod:`velox_zipcache.codec`), keys per channel, values channel-separable tokenwise. A coded
block is never coded again.

A window token's score is kept beside it (float32 per token and KV head, counted in
``nbytes``, saved with the state) until its block is coded. Tokens no query has scored when
their block is due (the model's attention is not routed to the cache, or tokens were stored
without attention) are coded with the newest ``salient`` share of each block taken as
salient (the paper's "locality" rule), below any scored token of the block; with
``score="locality"`` that is the rule for every token (no query scores).
"""

from __future__ import annotations

import warnings
from typing import Any

import mlx.core as mx

from velox_core import Packed, PresetCache, config_fields
from velox_core.cache.store import PackedStore
from velox_core.cache.stored import WINDOW_STEP

from .codec import MixedChannel, MixedSeparable
from .config import ZipCacheConfig
from .saliency import normalized_scores, probe_rows, top_per_block

__all__ = ["ZipCacheCache"]

_WARNED: list[bool] = []  # the unrouted warning, once per process


class ZipCacheCache(PresetCache):
    """ZipCache's cache for one layer. Parameters: see :class:`ZipCacheConfig`.

    Each KV head scores and codes its own tokens (its query heads' mean weights), so a model
    split by heads holds exactly its heads' share (``mixes_heads`` is empty).
    """

    method = "zipcache"
    Config = ZipCacheConfig
    # the window passes scored tokens on a block at a time (flush rounds up to whole blocks)
    default_flush = 1

    def __init__(self, flush: int | None = None, check_finite: bool = False, **params: Any):
        super().__init__(flush=flush, check_finite=check_finite, **params)
        # the scores of the window's oldest tokens, float32 (B, H, n, ) in window order
        self._sal = PackedStore(WINDOW_STEP)
        self._fresh_from = 0  # the first position the current update stores

    def build(self, cfg: ZipCacheConfig) -> dict[str, Any]:
        kb, vb = cfg.widths
        shared = config_fields(cfg, "low_bits", "salient", "group")
        keys = MixedChannel if cfg.key_axis == "channel" else MixedSeparable
        return {
            "key_codec": keys(kb, **shared),
            "value_codec": MixedSeparable(vb, **shared),
            # the codes sized exactly: a block appended joins the stored ones in one copy (once
            # per `group` decode steps), and no capacity slack (whose whole blocks, 100 tokens
            # against growth quanta of powers of two, would jump from one length to the next)
            "step": 1,
        }

    def named_stores(self) -> dict[str, PackedStore]:
        out = super().named_stores()
        sal = getattr(self, "_sal", None)  # absent while the base class initializes
        if sal is not None:
            out["saliency"] = sal
        return out

    # -- storing: every token passes through the window, scored before it is coded ----------
    def _write_window(self, keys: mx.array, values: mx.array) -> bool:
        return False  # every update runs the general path (the scores follow the window)

    def _direct(self) -> bool:
        return False  # a prefill is scored by its own queries before it is coded

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        self._fresh_from = self.offset
        return super().update_and_fetch(keys, values)

    def _flush(self, ahead: int = 0) -> None:
        """Code the scored window tokens past ``window``, whole blocks at a time (``ahead`` is
        always 0: the in-place decode path that passes it is off)."""
        g = self.cfg.group
        n_win = self.stored.window[0].tokens
        fresh = min(n_win, self.offset - self._fresh_from)  # stored by this update
        stale = (n_win - max(fresh, self._keep)) // g * g
        if stale > self._sal.tokens:
            self._assume(stale)
        n = min(self._sal.tokens, n_win - self._keep) // g * g
        if n and n >= self._flush_at:
            self._code(n)

    def _assume(self, upto: int) -> None:
        """Scores for the window tokens ``[scored, upto)`` that no query scored: the newest
        highest, all below zero (below any attention score)."""
        if not self.routed and not _WARNED and self.cfg.score != "locality":
            _WARNED.append(True)
            warnings.warn(
                "zipcache: tokens are coded without their saliency, which only velox "
                "attention sees (run the model inside velox_core.routed(model), as "
                "velox_core.generate does); each block's newest tokens count as salient",
                UserWarning,
                stacklevel=4,
            )
        b, h = self.stored.dims[:2]
        start = self.offset - self.stored.window[0].tokens
        pos = mx.arange(start + self._sal.tokens, start + upto)
        score = (pos - self.offset).astype(mx.float32)
        self._sal.append(Packed({"s": mx.broadcast_to(score, (b, h, score.size))}, score.size))

    def _code(self, n: int) -> None:
        """Code the window's oldest ``n`` tokens (whole blocks), their salient tokens by score."""
        t = self.tiers[0]
        pos0 = self.offset - self.stored.window[0].tokens
        keys = self.stored.window[0].view().slice(0, n).data["x"]
        values = self.stored.window[1].view().slice(0, n).data["x"]
        scores = self._sal.view().slice(0, n).data["s"]
        salient = top_per_block(scores, self.cfg.group, t.key_codec.count)
        self._append_body(
            t.key_codec.encode_mixed(keys, salient),
            t.value_codec.encode_mixed(values, salient),
            mx.arange(pos0, pos0 + n, dtype=mx.int32),
        )
        for s in (*self.stored.window, self._sal):
            s.drop_front(n)

    # -- scoring: the queries of every attention call ------------------------------------------
    def attend(
        self, queries: mx.array, scale: float, mask=None, sinks: mx.array | None = None
    ) -> mx.array:
        """Attention over every stored token (as any velox cache), then the scores of the
        window tokens this call's queries score (see the module)."""
        out = super().attend(queries, scale, mask, sinks)
        self._observe(queries, scale)
        return out

    def _observe(self, queries: mx.array, scale: float) -> None:
        g = self.cfg.group
        n_win, done = self.stored.window[0].tokens, self._sal.tokens
        lq = queries.shape[2]
        upto = n_win if lq > 1 else (n_win - self._keep) // g * g
        if upto <= done or self.cfg.score == "locality":
            return
        segs = self.segments()
        keys = mx.concatenate([s.key_codec.decode_as(s.keys, mx.float32) for s in segs], axis=2)
        rows = probe_rows(lq, self.cfg.probes, self.cfg.seed, self.offset - lq)
        c0 = self.size() - n_win
        norm = self.cfg.score == "normalized"
        scores = normalized_scores(queries, scale, keys, rows, (c0 + done, c0 + upto), norm)
        self._sal.append(Packed({"s": scores}, upto - done))
        mx.async_eval(self._sal.buf.data["s"])  # detach from the call's graph

    # -- what the cache holds -------------------------------------------------------------------
    def scores(self) -> mx.array | None:
        """The saliency scores of the window tokens scored so far (the oldest ones), or None.

        Shapes: returns float32 ``(B, H, n)``.
        """
        v = self._sal.view()
        return None if v is None else v.data["s"]

    def salient_tokens(self) -> mx.array | None:
        """Which coded tokens are salient (at ``bits``), or None before any is coded.

        Shapes: returns bool ``(B, H, T)`` over the coded tokens, oldest first.
        """
        v = self.stored.coded[0][0].view()
        return None if v is None else self.tiers[0].key_codec.salient_mask(v)

    # -- trimming --------------------------------------------------------------------------------
    def is_trimmable(self) -> bool:
        """False: which tokens are salient depends on queries a trim cannot take back, and a
        trim into a coded block decodes its survivors back into the window (to be coded
        again)."""
        return False

    def trim(self, n: int) -> int:
        """Remove the last ``n`` tokens (and the scores of trimmed window tokens); returns
        ``n``."""
        n_win = self.stored.window[0].tokens
        out = super().trim(n)
        self._sal.truncate(min(self._sal.tokens, max(n_win - n, 0)))
        return out
