"""A decode step's attention, planned once per coded segment.

A cache passes tokens to its codes ``flush`` at a time, so between two flushes every decode
step attends the same coded segment: the same records, the same shapes. The flush asks the
codecs for the segment's kernel sides (:meth:`PlannedAttention.refresh`,
:func:`velox_core.cache.attention.kernel_sides`) and keeps them with the kernel
configuration they were made under; the first step after it plans from them
(:func:`velox_core.kernels.decode.plan_segment`: layouts, templates, splits and checks
worked out once) and the steps after it only launch the kernels over that segment and the
cache's fp16 sinks and window. The plan is keyed by everything it was made for (the query's
shape and dtype, the scale, the segment's tokens and buffers, the sinks' buffer, whether the
window holds tokens, the configuration's generation, the default device) and dropped when
the segment changes; the queries' shape is checked when a plan is made
(:func:`check_queries`).
"""

from __future__ import annotations

import logging
from typing import Any

import mlx.core as mx

from ..codec.base import Codec
from ..kernels import config, disk_cache
from ..kernels.decode import plan_segment, plan_segment_ahead, probe_ahead_for
from ..kernels.joint import JointQuery
from ..kernels.layout import FP16_MAX
from .attention import kernel_sides

__all__: list[str] = []

_log = logging.getLogger("velox_core.kernels")
# the first decode steps planned ahead in this process (PlannedAttention.plan_ahead's keys)
_PLANNED_AHEAD: set[tuple] = set()
_NO_KERNEL = Codec.kernel_values  # the base codec's: no kernel mixes its values


def check_queries(stored: Any, queries: mx.array) -> None:
    """Raise a ``ValueError`` unless ``queries`` are ``(B, Hq, L, Dk)`` with the batch of
    ``stored`` (a cache's :class:`~velox_core.cache.stored.Stored`), a multiple of its KV
    heads and its key dim (unchecked before any update)."""
    if stored.dims is None:
        return
    b, h, dk, _ = stored.dims
    qs = tuple(getattr(queries, "shape", ()))
    if len(qs) != 4 or qs[0] != b or qs[1] % h or qs[3] != dk:
        raise ValueError(
            f"attend: queries {qs} must be (batch={b}, a multiple of {h} heads, L, key_dim={dk})"
        )


class PlannedAttention:
    """The joint decode attention of one :class:`~velox_core.cache.VeloxCache`, planned once
    per coded segment (see the module)."""

    __slots__ = ("_ahead", "_hold", "_key", "_run", "_shape", "_sides", "_sink")

    def __init__(self) -> None:
        self._shape: tuple | None = None  # the grouped query shape of the latest plan
        self._ahead = 0  # 1: the probe is seen to (probe_ahead), 2: nothing left to do ahead
        self.clear()

    def clear(self) -> None:
        """Drop the plan and the segment's sides (the cache's coded segment or sinks
        changed)."""
        self._key: tuple | None = None
        self._run: Any = None
        self._sink: tuple[mx.array, mx.array] | None = None
        self._hold: tuple | None = None
        self._sides: tuple | None = None

    def refresh(self, cache: Any) -> None:
        """The codes changed at a flush: drop the plan, and make the new segment's kernel
        sides now, for the query shape the latest plan was made for (none before a first
        plan); the next step plans from them."""
        self.clear()
        if self._shape is not None and len(cache.tiers) == 1:
            self._sides = self._make_sides(cache, self._shape)

    def _make_sides(self, cache: Any, q_shape: tuple) -> tuple:
        """``(key, sides or None, settings, buffers held)`` of the cache's coded
        segment for grouped queries of ``q_shape`` (the key: the segment's tokens and
        buffers, the shape, the configuration's generation and the default device)."""
        ks, vs = cache.stored.coded[0]
        key = (ks.tokens, id(ks.buf), id(vs.buf), q_shape, config.generation, mx.default_device())
        tier = cache.tiers[0]
        sides = None
        if ks.tokens:
            sides = kernel_sides(tier.key_codec, ks.view(), tier.value_codec, vs.view(), q_shape)
        # the key holds the buffers' ids: holding the buffers keeps those ids theirs
        return key, sides, config.kernel_config(), (ks.buf, vs.buf)

    def __call__(self, cache: Any, queries: mx.array, scale: float) -> mx.array | None:
        """Attention of ``queries`` (``(B, Hq, L, D)``, a few rows) over ``cache``'s sinks,
        single coded tier and window in one softmax, or None where no fused kernel takes the
        shape (the caller attends through the segments)."""
        # no plan where no kernel mixes the values: a value codec whose class keeps the base
        # kernel_values (fp16 values), which kernel_sides declines whatever the record (a
        # retention cache's body, which changes every step, would be planned every step)
        if len(cache.tiers) != 1 or type(cache.tiers[0].value_codec).kernel_values is _NO_KERNEL:
            return None
        stored = cache.stored
        ks, vs = stored.coded[0]
        sk = stored.sink[0]
        n_sink, n_win = sk.tokens, stored.window[0].tokens  # (a step's hot path: no properties)
        if ks.tokens == 0 or n_sink + n_win > FP16_MAX:
            return None
        b, hq, lq, d = queries.shape
        h = stored.dims[1]
        key = (
            queries.shape,
            queries.dtype,
            scale,
            ks.tokens,
            id(ks.buf),
            id(vs.buf),
            n_sink,
            id(sk.buf),
            n_sink + n_win > 0,  # no fp16 tokens: a kernel may merge its own splits
            config.generation,  # the kernel configuration in force (configure() bumps it)
            mx.default_device(),
        )
        if key != self._key:
            check_queries(stored, queries)  # a plan's key holds the shape it checked
            if disk_cache.kept:  # kernels kept on disk: the plan's first launches (the decode
                # kernel's, the merge's) compile together, waited for before the call returns
                with disk_cache.compiled_together():
                    self._plan(cache, key, (b, h, (hq // h) * lq, d), queries.dtype, scale)
                    return self(cache, queries, scale)
            self._plan(cache, key, (b, h, (hq // h) * lq, d), queries.dtype, scale)
        if self._run is None:
            return None
        fp16 = [] if self._sink is None else [self._sink]
        if n_win:  # the window's tokens, slices of its buffers (no copy)
            wk, wv = stored.window
            fp16.append((wk.buf.data["x"][:, :, :n_win], wv.buf.data["x"][:, :, :n_win]))
        out = self._run(queries.reshape(b, h, (hq // h) * lq, d), fp16)
        return None if out is None else out.reshape(b, hq, lq, -1)

    def _plan(self, cache: Any, key: tuple, q_shape, dtype: mx.Dtype, scale: float) -> None:
        stored = cache.stored
        ks, vs = stored.coded[0]
        sk, sv = stored.sink
        n_sink, n_win = key[6], stored.window[0].tokens
        self._shape = q_shape
        got = self._sides  # made at the flush for this shape, or made now
        if got is None or got[0] != (ks.tokens, id(ks.buf), id(vs.buf), q_shape, *key[9:]):
            got = self._make_sides(cache, q_shape)
        sides, settings = got[1:3]
        self.clear()
        self._sides = got
        if sides is not None:
            query = JointQuery(q_shape, dtype, n_sink + n_win, dtype, scale)
            self._run = plan_segment(query, *sides, settings)
        if n_sink:  # the sinks' tokens, slices of their buffers as the window's
            self._sink = (sk.buf.data["x"][:, :, :n_sink], sv.buf.data["x"][:, :, :n_sink])
        # the key holds the buffers' ids: holding the records keeps those ids theirs
        self._hold = (ks.buf, vs.buf, sk.buf)
        self._key = key

    # -- kernels compiled ahead of use (on CUDA, with the disk cache on) ------------------------

    def _ahead_of(self, cache: Any) -> bool:
        """Whether anything is left to compile ahead for ``cache``: a single coded tier holding
        tokens, no retention policy, no per-head storage, kernels compiled ahead here
        (:func:`~velox_core.kernels.disk_cache.compiles_ahead`)."""
        if self._ahead == 2:
            return False
        stored = cache.stored
        if (
            type(self).__call__ is not PlannedAttention.__call__  # a cache that plans its own way
            or not disk_cache.compiles_ahead()
            or len(cache.tiers) != 1
            or cache.policy is not None
            or stored.heads is not None
        ):
            self._ahead = 2
            return False
        return stored.coded[0][0].tokens > 0

    def probe_ahead(self, cache: Any) -> None:
        """At a write of coded tokens: where the tensor-core kernel takes the cache's codes, its
        subnormal probe (which the first decode step's plan runs, before any of that kernel's
        variants is known) starts compiling, beside the write's encodes."""
        if self._ahead == 0 and self._ahead_of(cache):
            self._ahead = 1
            b, h, dk, _ = cache.stored.dims
            try:
                _, sides, settings, _ = self._make_sides(cache, (b, h, 1, dk))
                if sides is not None:
                    probe_ahead_for((b, h, 1, dk), *sides, settings)
            except Exception:  # only time is at stake: the first plan runs the probe itself
                _log.debug("the probe is not compiled ahead", exc_info=True)

    def plan_ahead(self, cache: Any, queries: mx.array, scale: float) -> None:
        """At a prefill chunk's attention (``queries`` ``(B, Hq, L, D)``): the first decode step
        after it (one query token, written where the cache writes it: into the sinks, or the
        window and a flush) planned from the cache's coded segment and launched only to start
        its kernels' compiles in the background
        (:func:`~velox_core.kernels.decode.plan_segment_ahead`). Once per cache, and once per
        process for caches of the same description and shapes (a model's layers)."""
        if not self._ahead_of(cache):
            return
        self._ahead = 2
        stored = cache.stored
        b, h, dk, dv = stored.dims
        n_sink, n_win = stored.sink[0].tokens, stored.window[0].tokens
        if n_sink < cache.sinks:
            n_sink += 1
        else:
            n_win += 1 - cache._flush_count(n_win + 1)
        q_shape = (b, h, queries.shape[1] // h, queries.shape[3])
        dtype = queries.dtype
        key = (cache.describe(), q_shape, dtype, scale, n_sink > 0, n_win > 0, dv, stored.dtype)
        if n_sink + n_win > FP16_MAX or key in _PLANNED_AHEAD:
            return
        _PLANNED_AHEAD.add(key)
        fp16 = [((b, h, n, dk), (b, h, n, dv)) for n in (n_sink, n_win) if n]
        query = JointQuery(q_shape, dtype, n_sink + n_win, dtype, scale)
        try:
            _, sides, settings, _ = self._make_sides(cache, q_shape)
            if sides is not None:
                plan_segment_ahead(query, *sides, settings, fp16, stored.dtype)
        except Exception:  # only time is at stake: the step plans and compiles as it would
            _log.debug("the first decode step is not planned ahead", exc_info=True)
