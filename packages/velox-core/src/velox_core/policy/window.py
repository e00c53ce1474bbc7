"""The queries a policy keeps to score stored tokens by attention (velox-snapkv, velox-pyramidkv,
velox-tova, velox-morphkv's ``keep_weights=False``).

:class:`QueryWindow` buffers the newest ``size`` post-RoPE queries a layer attended with
(``size=1``: the last query alone), at consecutive absolute positions ending at ``end``, and
computes, when a cut is due, their softmax weights over the tokens the cache stores at that
moment (or reads the weights of the attention call that added them, while the cache has not
changed since) (:func:`~velox_core.policy.votes.window_votes`): the sinks, the body and the window
together, each token at its absolute position, so each query's softmax runs over everything
it can see (causally) and the weights never go stale through evictions, appends or trims.
:class:`WindowRows` and :class:`WindowState` give a policy that keeps one such window its
batch-row and state hooks.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx

from ..validation import check_int
from .votes import check_fusion, fuse_weights, window_weights

__all__: list[str] = []


class QueryWindow:
    """The newest ``size`` queries of a layer, and their weights over its stored tokens.

    Attributes:
        queries: the buffered queries, as ``VeloxCache.attend`` passes them (post-RoPE),
            or None: ``(B, Hq, n, D)`` with ``n <= size``.
        end: absolute position just after the newest buffered query; the queries sit at
            positions ``end - n ... end - 1``.
        scale: the model's attention scale of the last :meth:`add` (None before any).
    """

    def __init__(self, size: int):
        self.size = check_int("size", size, minimum=1)
        self.queries: mx.array | None = None
        self.end = 0
        self.scale: float | None = None
        # the buffered queries' softmax weights over the stored tokens (float32 (B, H, R, n,
        # S), the tokens in storage order), from the call that added them, and what they
        # cover (``_covered``), or None
        self.weights: mx.array | None = None
        self._weighed: tuple[int, int, int] | None = None

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
        again. The buffer is evaluated now (asynchronously) where it is a slice of a longer
        call's queries (so as not to hold them all) and where it was joined with the queries
        it held (so that the buffers of successive calls do not chain), unless ``detach`` is
        False: a policy whose next cut reads the buffer within a bounded number of calls,
        which evaluates it with that step's graph (a GPU step then does not wait for an
        evaluation a layer).

        Shapes:
            queries ``(B, Hq, L, D)``; weights float32 ``(B, H, R, L, S)``.
        """
        self.weights, self._weighed = None, None
        start = view.offset - queries.shape[2]  # position of this call's first query
        whole = queries.shape[2] <= self.size  # the call's every query is buffered
        new, old = (queries if whole else queries[:, :, -self.size :]), self.queries
        joined = False
        if old is not None and new.shape[2] < self.size and self.end >= start:
            before = start - (self.end - old.shape[2])  # buffered queries before `start`
            same = all(old.shape[i] == new.shape[i] for i in (0, 1, 3))
            joined = before > 0 and same
            if joined:
                old = old[:, :, :before][:, :, -(self.size - new.shape[2]) :]
                new = mx.concatenate([old.astype(new.dtype), new], axis=2)
        if weights is not None and not joined:
            w = weights if whole else weights[:, :, :, -self.size :]
            self.weights, self._weighed = w, _covered(view)
        self.queries = new if whole and not joined else mx.contiguous(new)
        self.end = view.offset
        self.scale = float(scale)
        if queries.shape[2] > self.size or (joined and detach):
            # a slice of a longer call's queries is evaluated now, not holding them all; a
            # joined buffer, so that the buffers of successive calls do not chain
            mx.async_eval(self.queries)

    def clear(self) -> None:
        """Drop the buffered queries (``end`` and ``scale`` stay, as saved)."""
        self.queries = None
        self.stored()

    def stored(self) -> None:
        """Tokens were stored (or the rows changed): the weights kept no longer cover them."""
        self.weights, self._weighed = None, None

    def votes(self, view, body_pos: mx.array, fusion: str = "sum") -> mx.array | None:
        """The buffered queries' softmax weights on the cache's body tokens, per KV head.

        Each query's softmax runs over every stored token at or before its position (sinks
        ``0 ... n_sink - 1``, the body at ``body_pos``, the window's newest ``n_win``
        positions before ``view.offset``; keys decoded by ``view.keys_and_values()``); the
        weights are averaged over the query heads of each KV head and fused over the queries,
        summed or (``fusion="max"``) their maximum
        (:func:`~velox_core.policy.votes.window_votes`). Queries whose tokens were trimmed
        away (at or after ``view.offset``) do not vote. Weights kept from the call that added
        the queries are read where they cover the stored tokens.

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
            return _body_columns(fuse_weights(self.weights, fusion), n_sink, t)
        first = self.end - q.shape[2]  # position of the first buffered query
        seen = min(q.shape[2], view.offset - first)  # queries trimmed away do not vote
        if seen <= 0:
            return None
        keys, _ = view.keys_and_values()  # sinks | body | window, decoded: (B, H, S, D)
        n_sink = view.sink_count()
        k_pos = _stored_positions(view, body_pos)
        q_pos = mx.arange(first, first + seen, dtype=mx.int32)
        p = window_weights(q[:, :, :seen], q_pos, keys, k_pos, self.scale)
        return _body_columns(fuse_weights(p, fusion), n_sink, t)

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


def _body_columns(votes: mx.array, n_sink: int, t: int) -> mx.array:
    """The ``t`` body columns after the ``n_sink`` sinks' of votes ``(B, H, S)`` over every
    stored token (the votes themselves where the body is every stored token)."""
    return votes if n_sink == 0 and t == votes.shape[2] else votes[:, :, n_sink : n_sink + t]


def _stored_positions(view, body_pos: mx.array | None = None) -> mx.array:
    """The absolute position of every stored token, in storage order (sinks, body, window):
    int32 ``(B, H, S)``; ``body_pos`` the body's ``(B, H, T)``, if at hand."""
    if body_pos is None:
        body_pos = view.body_positions(joined=True)
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

    def state(self) -> dict[str, mx.array]:
        return self.window.state("queries")

    def meta(self) -> Any:
        return {**super().meta(), **self.window.meta()}

    def set_state(self, state: dict[str, mx.array], meta: Any) -> None:
        state = dict(state)
        queries = state.pop("queries", None)
        super().set_state(state, meta)
        self.window.set_state(queries, meta)
