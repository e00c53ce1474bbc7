"""``PolicyView``: everything a retention policy may read of its cache, or do to it.

A :class:`~velox_core.cache.VeloxCache` with a retention policy makes one view of itself and
passes it to every hook of :class:`~velox_core.policy.base.RetentionPolicy` (``attach``,
``observe``, ``before_update``, ``after_update``, ``score``, ``select``,
``decode_segments``). The view holds the cache only in a private slot; it has no other
attributes and forwards nothing it does not name, so a policy sees the stored tokens
(decoded, with their absolute positions) and never how they are stored.

Terms: the *sinks* are the first tokens and the *window* the newest ones, both kept as
given and never evicted (the *protected* tokens); the *body* is every token between them,
coded by the cache's codecs, and is what a policy chooses from. ``B`` is the batch, ``H``
the KV heads, ``D`` / ``Dv`` the key / value channels, ``T_h`` the body tokens of head
``h`` (equal in every head until per-head budgets make the body *ragged*), ``S`` every
stored token of a head.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import mlx.core as mx

# reached as velox_core.policy.view.PolicyView (core's __all__ lists stay at their count)
__all__: list[str] = []


class Tokens(NamedTuple):
    """Stored tokens of one protected segment (the sinks or the window), as given.

    Attributes:
        keys: ``(B, H, n, D)`` in the storage dtype (:attr:`PolicyView.dtype`), None when
            the segment is empty.
        values: ``(B, H, n, Dv)`` in the storage dtype, None when empty.
        positions: absolute positions, int32 ``(n,)`` (the same in every row and head).
    """

    keys: mx.array | None
    values: mx.array | None
    positions: mx.array


class PolicyView:
    """A retention policy's view of one cache: its counts, its tokens, its layout and two
    actions (:meth:`evict`, :meth:`set_body_values`).

    Made once by the cache (``VeloxCache.policy_view``); every member reads the cache as it
    is when called. Arrays are lazy (nothing is decoded unless used).

    Args:
        cache: the :class:`~velox_core.cache.VeloxCache` viewed.
    """

    __slots__ = ("_cache",)

    def __init__(self, cache) -> None:
        self._cache = cache

    def __repr__(self) -> str:
        return f"<PolicyView of {self._cache!r}>"

    # -- counts ------------------------------------------------------------------------------
    @property
    def offset(self) -> int:
        """Tokens the cache has seen: the absolute position of the next token (evictions do
        not renumber)."""
        return self._cache.offset

    @property
    def sinks(self) -> int:
        """Sink tokens the cache keeps (its ``sinks`` setting: the first tokens, as given)."""
        return self._cache.sinks

    @property
    def window(self) -> int:
        """Newest tokens the cache keeps as given (its ``window`` setting)."""
        return self._cache.window

    def size(self) -> int:
        """Tokens stored per KV head (the widest head's when the body is ragged): sinks, body
        and window."""
        return self._cache.size()

    def body_sizes(self) -> list[int]:
        """Body tokens of each KV head: ``H`` ints (empty before the first update)."""
        return self._cache.body_sizes()

    def sink_count(self) -> int:
        """Sink tokens stored (at most :attr:`sinks`; fewer while the prompt is shorter)."""
        return self._cache.stored.n_sink

    def protected_count(self) -> int:
        """Tokens stored per KV head that no eviction touches: the sinks and the window."""
        return self._cache.protected()

    # -- tokens ------------------------------------------------------------------------------
    def body_keys(self) -> list[mx.array | None]:
        """Decoded body keys: one ``(B, 1, T_h, D)`` array per KV head (None where a head
        holds no body token), float32 where a codec codes the keys, in :attr:`dtype` where
        they are kept as given (no key codec)."""
        return self._body(0)

    def body_values(self, stop: int | None = None, joined: bool = False):
        """Decoded body values, float32: one ``(B, 1, T_h, Dv)`` array per KV head (None
        where a head holds no body token); with ``stop``, each head's first ``stop`` tokens
        alone (``T_h`` at most ``stop``: only those are decoded where the codec decodes a
        slice of its record exactly). With ``joined``, one ``(B, H, T, Dv)`` array of every
        head (None where a head holds no body token; ``ValueError`` where ragged heads hold
        different counts): the per-head arrays concatenated along the heads."""
        if joined:
            x = self._body(1, stop, joined=True)
            return None if x is None else x.astype(mx.float32)
        return [None if v is None else v.astype(mx.float32) for v in self._body(1, stop)]

    def body_positions(self, joined: bool = False):
        """Absolute positions of the body tokens, ascending: one int32 ``(B, T_h)`` array per
        KV head (None where a head holds no body token). With ``joined``, one int32 ``(B, H,
        T)`` array of every head (None where a head holds no body token; ``ValueError``
        where ragged heads hold different counts): the per-head arrays stacked."""
        st = self._cache.stored
        if st.heads is not None:  # ragged: one record per head
            per = [p.view().data["x"][:, 0, :, 0] if p.tokens else None for _, _, p in st.heads]
            return _joined(per, mx.stack) if joined else per
        pv = st.positions.view()
        if pv is None:
            return None if joined else [None] * st.dims[1]
        pos = pv.data["x"][..., 0]
        return pos if joined else [pos[:, h] for h in range(pos.shape[1])]

    def _body(self, side: int, stop: int | None = None, joined: bool = False):
        """The body's keys (``side`` 0) or values (1) decoded by their codec, per KV head (or
        ``joined``: one array of every head, None where a head holds none); the first
        ``stop`` tokens of each alone, if given."""
        st, codec = self._cache.stored, self.codecs[side]
        if st.heads is not None:
            per = [
                _decode(codec, s[side].view(), stop) if s[side].tokens else None for s in st.heads
            ]
            return _joined(per, mx.concatenate) if joined else per
        rec = st.coded[0][side].view()
        if rec is None:
            return None if joined else [None] * st.dims[1]
        x = _decode(codec, rec, stop)
        return x if joined else [x[:, h : h + 1] for h in range(x.shape[1])]

    def protected(self) -> tuple[Tokens, Tokens]:
        """The sinks and the window as stored (never evicted): ``(sinks, window)``, each a
        :class:`Tokens` of keys ``(B, H, n, D)`` and values ``(B, H, n, Dv)`` in the storage
        dtype (None when empty) and int32 positions ``(n,)``."""
        c = self._cache
        st = c.stored
        n_sink, n_win = st.n_sink, st.n_window
        sink = Tokens(*_as_given(st.sink), mx.arange(n_sink, dtype=mx.int32))
        win = Tokens(*_as_given(st.window), mx.arange(c.offset - n_win, c.offset, dtype=mx.int32))
        return sink, win

    def keys_and_values(self) -> tuple[mx.array, mx.array]:
        """Every stored token decoded, in storage order (sinks, body, window), in the dtype
        the model gave: keys ``(B, H, S, D)`` and values ``(B, H, S, Dv)``. Raises a
        ``ValueError`` while the cache is empty, and with a ragged body."""
        return self._cache.keys_and_values()

    def segments(self) -> list:
        """The stored tokens as attention reads them, in temporal order: the sinks (if any),
        the coded body, the window (if any), each a
        :class:`~velox_core.cache.attention.Segment` (codecs and their records), for
        :meth:`~velox_core.policy.base.RetentionPolicy.decode_segments`. Raises a
        ``ValueError`` with a ragged body (its segments differ by head)."""
        return self._cache.segments()

    # -- layout ------------------------------------------------------------------------------
    @property
    def batch(self) -> int | None:
        """Batch rows ``B`` (None before the first update)."""
        dims = self._cache.stored.dims
        return None if dims is None else dims[0]

    @property
    def kv_heads(self) -> int | None:
        """KV heads ``H`` (None before the first update)."""
        return self._cache.kv_heads

    @property
    def key_dim(self) -> int | None:
        """Channels of a key ``D`` (None before the first update)."""
        return self._cache.key_dim

    @property
    def value_dim(self) -> int | None:
        """Channels of a value ``Dv`` (None before the first update)."""
        dims = self._cache.stored.dims
        return None if dims is None else dims[3]

    @property
    def dtype(self) -> mx.Dtype | None:
        """The dtype tokens kept as given are stored in (the sinks, the window, and values
        written by :meth:`set_body_values` before coding); None before the first update."""
        return self._cache.stored.dtype

    @property
    def codecs(self) -> tuple[Any, Any]:
        """The body's ``(key_codec, value_codec)``: what one body token costs is measured by
        coding one (``codec.encode(...).nbytes``); a policy does not code with them."""
        t = self._cache.tiers[0]
        return t.key_codec, t.value_codec

    @property
    def ragged(self) -> bool:
        """True once per-head budgets made the body heads' lengths differ (one record per KV
        head, batch 1): :meth:`keys_and_values`, :meth:`segments` and
        :meth:`set_body_values` then refuse."""
        return self._cache.ragged

    @property
    def routed(self) -> bool:
        """True while attention is routed to velox caches (``velox_core.routed``): only then
        does :meth:`~velox_core.policy.base.RetentionPolicy.observe` see the queries."""
        return self._cache.routed

    # -- actions -----------------------------------------------------------------------------
    def evict(self, keep) -> None:
        """Keep only the named body tokens (the rest leave memory).

        Args:
            keep: indices into the body, ascending (temporal order is kept): an int array
                ``(n,)`` shared by every head, ``(B, H, n)`` per head, or a list of one
                ``(n_h,)`` array per KV head (per-head budgets: makes the body ragged;
                batch 1 only).
        """
        self._cache.evict(keep)

    def set_body_values(self, start: int, values: mx.array) -> None:
        """Overwrite the values of body tokens ``[start, start + n)`` in every head, coded by
        the value codec (for a policy that merges values into the tokens it keeps, as
        velox-cam's does); keys and positions are untouched. Raises a ``ValueError`` with a
        ragged body, an empty cache, or tokens outside the body.

        Shapes:
            values ``(B, H, n, Dv)``, any float dtype (stored in :attr:`dtype`).
        """
        self._cache.set_body_values(start, values)


def _decode(codec, rec, stop: int | None) -> mx.array:
    """``codec.decode(rec)``, or its first ``stop`` tokens: only the whole blocks that hold
    them decoded where the codec decodes a slice exactly (``Codec.decodes_slices``)."""
    if stop is None or stop >= rec.tokens:
        return codec.decode(rec)
    stop = max(stop, 0)
    if codec.decodes_slices:
        rec = rec.slice(0, min(-(-stop // rec.block) * rec.block, rec.tokens))
    x = codec.decode(rec)
    return x if x.shape[2] == stop else x[:, :, :stop]


def _joined(per: list, join) -> mx.array | None:
    """Per-head arrays of a ragged body joined along the heads by ``join`` (``mx.stack`` or a
    concatenation), None where a head holds none; ``ValueError`` where their lengths differ."""
    if any(x is None for x in per):
        return None
    if len({x.shape for x in per}) > 1:
        raise ValueError(
            "joined: the KV heads hold different numbers of body tokens (per-head budgets); "
            "read them head by head"
        )
    return join(per, axis=1)


def _as_given(stores) -> tuple[mx.array | None, mx.array | None]:
    """The keys and values of a segment kept as given (``(key_store, value_store)``)."""
    k, v = stores[0].view(), stores[1].view()
    return (None if k is None else k.data["x"]), (None if v is None else v.data["x"])
