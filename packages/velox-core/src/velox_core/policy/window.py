"""The queries a policy keeps to score stored tokens by attention (velox-snapkv, velox-pyramidkv,
velox-tova).

:class:`QueryWindow` buffers the newest ``size`` post-RoPE queries a layer attended with
(``size=1``: the last query alone), at consecutive absolute positions ending at ``end``, and
computes, when a cut is due, their softmax weights over the tokens the cache stores at that
moment (or reads the weights of the attention call that added them, while the cache has not
changed since) (:func:`~velox_core.policy.votes.window_votes`): the sinks, the body and the window
together, each token at its absolute position, so each query's softmax runs over everything
it can see (causally) and the weights never go stale through evictions, appends or trims.
A *rolling* window (velox-morphkv's, which cuts at every decode step) keeps those weights
instead, from one cut to the next: each call's weights join them, and a cut keeps the kept
tokens' columns, so that a cut renormalizes the weights it holds rather than scoring every
buffered query again.
:class:`WindowRows` and :class:`WindowState` give a policy that keeps one such window its
batch-row and state hooks.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx

from ..codec.identity import Identity
from ..validation import check_int
from .votes import check_fusion, fuse_weights, renormalized_votes, window_weights

__all__: list[str] = []


class QueryWindow:
    """The newest ``size`` queries of a layer, and their weights over its stored tokens.

    Attributes:
        queries: the buffered queries, as ``VeloxCache.attend`` passes them (post-RoPE),
            or None: ``(B, Hq, n, D)`` with ``n <= size``.
        end: absolute position just after the newest buffered query; the queries sit at
            positions ``end - n ... end - 1``.
        scale: the model's attention scale of the last :meth:`add` (None before any).
        rolling: whether the buffered queries' weights are kept from one cut to the next
            (:meth:`appended`, :meth:`kept`): a cut then renormalizes them over the tokens
            still stored (each query's softmax over those tokens, as scoring it again
            gives) instead of scoring the queries again. They cost ``B * Hq * size * S``
            float32 (``S`` the stored tokens); the queries' own ``B * Hq * size * D``
            are kept either way.
    """

    def __init__(self, size: int, rolling: bool = False):
        self.size = check_int("size", size, minimum=1)
        self.rolling = bool(rolling)
        self.queries: mx.array | None = None
        self.end = 0
        self.scale: float | None = None
        # the buffered queries' softmax weights over the stored tokens (float32 (B, H, R, n,
        # C), the tokens in storage order), from the call that added them or, rolling, kept
        # since, and what they cover (``_covered``), or None. Rolling, the columns past the
        # ``S`` stored tokens (C >= S) are zero, room for the tokens stored next, and the
        # rows are a ring: query i (the oldest first) is row (_ring + i) % n
        self.weights: mx.array | None = None
        self._weighed: tuple[int, int, int] | None = None
        self._ring = 0

    def add(
        self,
        view,
        queries: mx.array,
        scale: float,
        weights: mx.array | None = None,
        detach: bool = True,
    ) -> None:
        """Buffer the newest ``size`` of one attention call's queries (the call's tokens are
        the newest stored ones, ending at ``view.offset``).

        A call with fewer than ``size`` queries keeps the newest buffered ones that precede
        it (queries at or after its first position, trimmed away since, are replaced), as
        long as the buffer ends where the call starts or later and the batch and head layout
        match; otherwise the buffer starts over from this call.

        ``weights``, the call's attention weights (``RetentionPolicy.observe_weights``), are
        kept where the call holds every buffered query (the buffer started over from this
        call): until the cache changes, :meth:`votes` reads them instead of computing them
        again. Rolling, a call joined to the buffered queries joins its weights to theirs,
        where those cover the stored tokens (:meth:`appended`); a call that brings none has
        its queries' weights computed here (they see every stored token). The buffer is
        evaluated now (asynchronously) where it is a slice of a longer call's queries (so as
        not to hold them all) and where it was joined with the queries it held (so that the
        buffers of successive calls do not chain), unless ``detach`` is False: a policy
        whose next cut reads the buffer within a bounded number of calls, which evaluates it
        with that step's graph (a GPU step then does not wait for an evaluation a layer).

        Shapes:
            queries ``(B, Hq, L, D)``; weights float32 ``(B, H, R, L, S)``.
        """
        covered = _covered(view)
        held = self.weights if self.rolling and self._weighed == covered else None
        self.weights, self._weighed = None, None
        start = view.offset - queries.shape[2]  # position of this call's first query
        new, old = queries[:, :, -self.size :], self.queries
        joined, rows = False, None  # rows: the held weights of the buffered queries kept
        if old is not None and new.shape[2] < self.size and self.end >= start:
            before = start - (self.end - old.shape[2])  # buffered queries before `start`
            same = all(old.shape[i] == new.shape[i] for i in (0, 1, 3))
            joined = before > 0 and same
            if joined:
                old = old[:, :, :before][:, :, -(self.size - new.shape[2]) :]
                if held is not None and before >= held.shape[3] == self.queries.shape[2]:
                    rows = held  # their newest old.shape[2] rows stay
                new = mx.concatenate([old.astype(new.dtype), new], axis=2)
        if weights is None and rows is not None:
            q = new[:, :, old.shape[2] :]
            q_pos = mx.arange(start, view.offset, dtype=mx.int32)
            keys, _ = view.keys_and_values()
            weights = window_weights(q, q_pos, keys, _stored_positions(view), scale)
        if weights is not None and (not joined or rows is not None):
            w = weights[:, :, :, -self.size :]
            if rows is None:
                self.weights, self._ring = w, 0
            else:
                self.weights = self._roll(rows, old.shape[2], w)
            self._weighed = covered
        else:
            self._ring = 0
        self.queries = mx.contiguous(new)
        self.end = view.offset
        self.scale = float(scale)
        if queries.shape[2] > self.size or (joined and detach):
            # a slice of a longer call's queries is evaluated now, not holding them all; a
            # joined buffer, so that the buffers of successive calls do not chain (nor the
            # rolling weights)
            rolled = [self.weights] if joined and rows is not None else []
            mx.async_eval(self.queries, *rolled)

    def clear(self) -> None:
        """Drop the buffered queries (``end`` and ``scale`` stay, as saved)."""
        self.queries = None
        self.stored()

    def stored(self) -> None:
        """Tokens were stored (or the rows changed): the kept weights no longer cover them."""
        self.weights, self._weighed, self._ring = None, None, 0

    def _roll(self, held: mx.array, kept: int, rows: mx.array) -> mx.array:
        """The held weights' newest ``kept`` rows, then ``rows``, the newest queries'. Where
        as many rows leave as arrive (the buffer full), the new rows overwrite the oldest in
        place (the ring turns); otherwise the rows are laid out anew, oldest first.

        Shapes:
            held float32 ``(B, H, R, n, C)``, rows ``(B, H, R, L, S)`` with ``S <= C``;
            returns ``(B, H, R, kept + L, C)``.
        """
        b, h, r, n, c = held.shape
        new, s = rows.shape[3], rows.shape[4]
        if kept + new == n:
            for i in range(new):  # over the rows that leave, the columns of stored tokens
                slot = (self._ring + i) % n
                held[:, :, :, slot : slot + 1, :s] = rows[:, :, :, i : i + 1]
            self._ring = (self._ring + new) % n
            return held
        if self._ring:
            held = mx.take(held, (mx.arange(n) + self._ring) % n, axis=3)
        if c > s:
            rows = mx.concatenate([rows, mx.zeros((b, h, r, new, c - s), dtype=rows.dtype)], 4)
        self._ring = 0
        return mx.concatenate([held[:, :, :, n - kept :], rows], axis=3)

    def appended(self, view, start: int) -> None:
        """Tokens ``[start, view.offset)`` were just stored (``RetentionPolicy.after_update``).

        Rolling, weights that covered the tokens stored before them gain their columns, zero:
        the buffered queries precede them and cannot see them (zero columns held for them by
        the last cut, or added now). They are dropped instead
        (:meth:`stored`; the next cut scores the queries again) where they cover other
        tokens, and where window tokens they weigh may have moved into a body whose key codec
        is lossy (their keys then changed). Not rolling: :meth:`stored`.
        """
        w, cov, ring = self.weights, self._weighed, self._ring
        self.stored()
        if not self.rolling or w is None or cov is None:
            return
        n = view.offset - start
        now = _covered(view)
        if cov[:2] != (start, now[1] - n) or (cov[2] and not isinstance(view.codecs[0], Identity)):
            return
        b, h, r, q, c = w.shape
        need = now[1] + 1 - c  # zero columns missing: the new tokens' and one spare (kept)
        if need > 0:
            w = mx.concatenate([w, mx.zeros((b, h, r, q, need), dtype=w.dtype)], axis=4)
        self.weights, self._weighed, self._ring = w, now, ring

    def kept(self, view, index: mx.array, room: int = 1) -> None:
        """A cut keeps the body tokens at ``index`` (called before ``view.evict(index)``).

        Rolling, weights that cover the stored tokens keep, in one gather, the columns of the
        tokens that stay (the sinks, those body tokens, the window), then ``room`` zero
        columns for the tokens stored before the next cut and one spare. Otherwise
        :meth:`stored`.

        Shapes:
            index int ``(k,)`` or ``(B, H, k)``, ascending (as ``PolicyView.evict``'s).
        """
        w, cov = self.weights, self._weighed
        if not self.rolling or w is None or cov != _covered(view):
            self.stored()
            return
        offset, size, n_win = cov
        b, h, r, q, c = w.shape
        if c == size:  # a zero column to gather the new ones from
            w = mx.concatenate([w, mx.zeros((b, h, r, q, 1), dtype=w.dtype)], axis=4)
        n_sink = view.sink_count()
        idx = index.astype(mx.int32)
        if idx.ndim == 1:
            idx = mx.broadcast_to(idx, (b, h, idx.shape[0]))
        k = idx.shape[2]
        cols = [mx.arange(n_sink, dtype=mx.int32), idx + n_sink]
        cols.append(mx.arange(size - n_win, size, dtype=mx.int32))
        cols.append(mx.full((room + 1,), w.shape[4] - 1, dtype=mx.int32))
        cols = [mx.broadcast_to(c, (b, h, c.shape[-1])) for c in cols if c.shape[-1]]
        cols = mx.concatenate(cols, axis=2)
        self.weights = mx.take_along_axis(w, cols[:, :, None, None, :], axis=4)
        self._weighed = (offset, n_sink + k + n_win, n_win)

    def votes(self, view, body_pos: mx.array, fusion: str = "sum") -> mx.array | None:
        """The buffered queries' softmax weights on the cache's body tokens, per KV head.

        Each query's softmax runs over every stored token at or before its position (sinks
        ``0 ... n_sink - 1``, the body at ``body_pos``, the window's newest ``n_win``
        positions before ``view.offset``; keys decoded by ``view.keys_and_values()``); the
        weights are averaged over the query heads of each KV head and fused over the queries,
        summed or (``fusion="max"``) their maximum
        (:func:`~velox_core.policy.votes.window_votes`). Queries whose tokens were trimmed
        away (at or after ``view.offset``) do not vote. Weights kept from the call that added
        the queries (or, rolling, since) are read where they cover the stored tokens, each
        query's renormalized over them when rolling
        (:func:`~velox_core.policy.votes.renormalized_votes`); rolling, weights computed
        here are kept.

        Shapes:
            body_pos int ``(B, H, T)``, the body's absolute positions (as
            ``mx.stack(view.body_positions(), axis=1)``); returns float32 ``(B, H, T)``, or
            None when no buffered query can vote (none, another batch size, all trimmed).
        """
        check_fusion(fusion)
        q = self.queries
        b, _, t = body_pos.shape
        if q is None or q.shape[0] != b:
            return None
        if self.weights is not None and self._weighed == _covered(view):
            n_sink = view.sink_count()  # the weights held, over the same tokens
            fuse = renormalized_votes if self.rolling else fuse_weights
            return fuse(self.weights, fusion)[:, :, n_sink : n_sink + t]
        first = self.end - q.shape[2]  # position of the first buffered query
        seen = min(q.shape[2], view.offset - first)  # queries trimmed away do not vote
        if seen <= 0:
            return None
        keys, _ = view.keys_and_values()  # sinks | body | window, decoded: (B, H, S, D)
        n_sink = view.sink_count()
        k_pos = _stored_positions(view, body_pos)
        q_pos = mx.arange(first, first + seen, dtype=mx.int32)
        p = window_weights(q[:, :, :seen], q_pos, keys, k_pos, self.scale)
        if self.rolling and seen == q.shape[2]:
            self.weights, self._weighed, self._ring = p, _covered(view), 0
        return fuse_weights(p, fusion)[:, :, n_sink : n_sink + t]

    # -- batch rows ---------------------------------------------------------------------------
    def filter_batch(self, idx: mx.array) -> None:
        """Keep the queries of these batch rows (``VeloxCache.filter``)."""
        self.stored()
        if self.queries is not None:
            self.queries = self.queries[idx]

    def extend_batch(self, other: QueryWindow) -> None:
        """Append ``other``'s rows; buffers of other positions or layouts cannot be joined, so
        the queries are dropped (the next cut votes with the queries that arrive next)."""
        self.stored()
        a, b = self.queries, other.queries
        if a is None or b is None or a.shape[1:] != b.shape[1:] or self.end != other.end:
            self.queries = None
            return
        self.queries = mx.concatenate([a, b.astype(a.dtype)], axis=0)

    # -- state --------------------------------------------------------------------------------
    def state(self, name: str = "queries") -> dict[str, mx.array]:
        """The queries under ``name`` (the policy's state key), or nothing."""
        return {} if self.queries is None else {name: self.queries}

    def meta(self) -> dict[str, Any]:
        """``{"q_end": end, "scale": scale}``."""
        return {"q_end": self.end, "scale": self.scale}

    def set_state(self, queries: mx.array | None, meta: dict[str, Any] | None) -> None:
        """Restore from :meth:`state`'s array and :meth:`meta` (missing keys: the defaults)."""
        if queries is not None and (queries.ndim != 4 or queries.shape[2] > self.size):
            raise ValueError(
                f"the kept queries must be (B, Hq, n <= {self.size}, D), got {queries.shape}"
            )
        meta = meta or {}
        self.stored()
        self.queries = queries
        self.end = int(meta.get("q_end", 0))
        scale = meta.get("scale")
        self.scale = None if scale is None else float(scale)


def _covered(view) -> tuple[int, int, int]:
    """What weights over the stored tokens cover: the offset, the stored tokens and the
    window's."""
    sizes = view.body_sizes()
    size = view.size()
    return view.offset, size, size - view.sink_count() - (sizes[0] if sizes else 0)


def _stored_positions(view, body_pos: mx.array | None = None) -> mx.array:
    """The absolute position of every stored token, in storage order (sinks, body, window):
    int32 ``(B, H, S)``; ``body_pos`` the body's ``(B, H, T)``, if at hand."""
    if body_pos is None:
        body_pos = mx.stack(view.body_positions(), axis=1)
    b, h, t = body_pos.shape
    n_sink = view.sink_count()
    n_win = view.size() - n_sink - t
    sink_pos = mx.broadcast_to(mx.arange(n_sink, dtype=mx.int32), (b, h, n_sink))
    win_pos = mx.arange(view.offset - n_win, view.offset, dtype=mx.int32)
    return mx.concatenate(
        [sink_pos, body_pos.astype(mx.int32), mx.broadcast_to(win_pos, (b, h, n_win))], axis=2
    )


class WindowRows:
    """The batch-row hooks (``VeloxCache.filter`` / ``extend``) of a retention policy that
    keeps its queries in one :class:`QueryWindow`, ``self.window``; mixed in before
    :class:`~velox_core.RetentionPolicy`. Extended by a batch of other positions, the
    window drops its queries: the next queries vote."""

    window: QueryWindow

    def filter_batch(self, idx: mx.array) -> None:
        self.window.filter_batch(idx)

    def extend_batch(self, other: WindowRows) -> None:
        self.window.extend_batch(other.window)


class WindowState(WindowRows):
    """:class:`WindowRows`, and the state hooks of a policy whose state is the window's
    queries (velox-core's ``WindowVotePolicy``, velox-morphkv), extending
    :class:`~velox_core.RetentionPolicy`'s ``meta`` and ``set_state``.

    State: ``{"queries": (B, Hq, n, D)}`` (absent once dropped); meta adds ``q_end`` and
    ``scale`` (:meth:`QueryWindow.meta`).
    """

    # the buffered queries and the position after them (tests read them)
    @property
    def _queries(self) -> mx.array | None:
        return self.window.queries

    @property
    def _q_end(self) -> int:
        return self.window.end

    def state(self) -> dict[str, mx.array]:
        return self.window.state("queries")

    def meta(self) -> Any:
        return {**super().meta(), **self.window.meta()}

    def set_state(self, state: dict[str, mx.array], meta: Any) -> None:
        state = dict(state)
        queries = state.pop("queries", None)
        super().set_state(state, meta)
        self.window.set_state(queries, meta)
