"""A decode step's attention, planned once per coded segment.

A cache passes tokens to its codes ``flush`` at a time, so between two flushes every decode
step attends the same coded segment: the same records, the same shapes. The first step asks
the kernels for a plan (whether they are on; the segment's kernel sides,
:func:`velox_core.cache.attention.kernel_sides`, planned by
:func:`velox_core.kernels.joint.plan_segment`: the layouts, templates, splits and checks
worked out once) and the steps after it only launch the kernels over that segment and the
cache's fp16 sinks and window. The plan is keyed by everything it
was made for (the query's shape and dtype, the scale, the segment's tokens and buffers, the
sinks' buffer, whether the window holds tokens, the kernel configuration in force and the
default device) and dropped when the segment changes. The queries' shape is checked when a
plan is made (a step with the same key has the shape checked).
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx

from ..kernels import config, use_kernels
from ..kernels.decode import plan_segment
from ..kernels.joint import JointQuery
from ..kernels.layout import FP16_MAX
from .attention import kernel_sides

__all__: list[str] = []


class PlannedAttention:
    """The joint decode attention of one :class:`~velox_core.cache.VeloxCache`, planned once
    per coded segment (see the module)."""

    __slots__ = ("_hold", "_key", "_run", "_sink")

    def __init__(self) -> None:
        self.clear()

    def clear(self) -> None:
        """Drop the plan (the cache's coded segment or sinks changed)."""
        self._key: tuple | None = None
        self._run: Any = None
        self._sink: tuple[mx.array, mx.array] | None = None
        self._hold: tuple | None = None

    def __call__(self, cache: Any, queries: mx.array, scale: float) -> mx.array | None:
        """Attention of ``queries`` (``(B, Hq, L, D)``, a few rows) over ``cache``'s sinks,
        single coded tier and window in one softmax, or None where no fused kernel takes the
        shape (the caller attends through the segments)."""
        if len(cache.tiers) != 1:
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
            cache.check_queries(queries)  # a plan's key holds the shape it checked
            self._plan(cache, key, (b, h, (hq // h) * lq, d), queries.dtype, scale)
        if self._run is None:
            return None
        fp16 = [] if self._sink is None else [self._sink]
        if n_win:  # the window's tokens, slices of its buffers (stored.window_arrays())
            wk, wv = stored.window
            fp16.append((wk.buf.data["x"][:, :, :n_win], wv.buf.data["x"][:, :, :n_win]))
        out = self._run(queries.reshape(b, h, (hq // h) * lq, d), fp16)
        return None if out is None else out.reshape(b, hq, lq, -1)

    def _plan(self, cache: Any, key: tuple, q_shape, dtype: mx.Dtype, scale: float) -> None:
        stored = cache.stored
        ks, vs = stored.coded[0]
        tier = cache.tiers[0]
        n_sink, n_win = key[6], stored.n_window
        self.clear()
        on = use_kernels()
        sides = on and kernel_sides(tier.key_codec, ks.view(), tier.value_codec, vs.view(), q_shape)
        if sides:
            query = JointQuery(tuple(q_shape), dtype, n_sink + n_win, dtype, scale)
            self._run = plan_segment(query, *sides)
        if n_sink:
            self._sink = (stored.sink[0].view().data["x"], stored.sink[1].view().data["x"])
        # the key holds the buffers' ids: holding the records keeps those ids theirs
        self._hold = (ks.buf, vs.buf, stored.sink[0].buf)
        self._key = key
