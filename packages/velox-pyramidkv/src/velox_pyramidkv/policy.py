"""``PyramidKVPolicy``: SnapKV's selection under a per-layer pyramid budget (arXiv 2406.02069).

PyramidKV (Cai et al.) observes that attention funnels with depth: bottom layers spread
their attention over the whole prompt, top layers concentrate it on a few tokens. So it
gives each layer its own budget, falling linearly from the bottom layer to the top one
(:func:`velox_pyramidkv.layer_budget`: the average stays ``budget``, so the whole model keeps
as many tokens as a uniform budget would), and inside each layer keeps the tokens SnapKV
keeps: the observation window's votes (:func:`velox_core.policy.window_votes`), pooled
(:func:`velox_core.policy.pool_votes`), top ``layer budget - protected`` per KV head, plus the
window itself (scored ``+inf``).

How it runs in velox: exactly as velox-snapkv's policy, with the layer's budget in place of
the uniform one. :meth:`PyramidKVPolicy.observe` keeps the newest ``observe`` post-RoPE
queries (through ``VeloxCache.attend``: routed attention only); ``before_update`` cuts the
layer to its budget after each prefill chunk (and, with ``every``, during decode), the
budget computed from ``cache.offset`` (the prompt seen so far, the same in every layer).

The layer's place in the pyramid (``layer``, ``n_layers``) comes from ``make_cache``:
``bind(model, i)`` places it among the model's layers, and ``PyramidKVCache.link_layers``
then among the layers that hold a PyramidKV cache (so layers left to the model's own cache,
sliding-window ones say, take no share). A cache made without a model must be given
``layer`` and ``n_layers``; otherwise the first cut that needs them (once the prompt exceeds
``budget``) raises ``ValueError`` naming ``make_cache(model, ...)``, and so does
``bind(None, i)``. A layer never keeps fewer than ``sinks + max(window, observe)`` tokens:
the pyramid shares out only the tokens beyond those (the top layer's share may round to 0).

Deviations from the paper (also in docs/pyramidkv.md): SnapKV's in velox (chunked prefill,
GQA votes averaged per KV head, optional decode cuts, a cut refused without routing), and the
schedule's (:mod:`velox_pyramidkv.schedule`).
"""

from __future__ import annotations

import warnings
from typing import Any

import mlx.core as mx

from velox_core import RetentionPolicy
from velox_core.policy import WindowVote, window_votes
from velox_core.validation import check_int

from .config import check_beta, check_place
from .schedule import layer_budget

__all__ = ["PyramidKVPolicy"]

_WARNED = [False]


class PyramidKVPolicy(RetentionPolicy):
    """PyramidKV's retention policy.

    Args:
        budget: tokens kept per KV head, averaged over the pyramid's layers, or None.
        every: during decode, cut again once the layer holds its budget + ``every`` tokens
            (None: only after prefill chunks, as the paper).
        observe: size of the observation window (queries that vote, newest tokens kept).
        kernel: odd pooling kernel size along tokens (1: no pooling).
        pooling: ``"max"`` or ``"avg"``.
        beta: the pyramid's steepness (>= 1; 1 is SnapKV's uniform budget).
        layer, n_layers: the place in the pyramid (set by ``bind`` / ``link_layers``).
    """

    name = "pyramidkv"
    settings = ("beta", "layer", "n_layers")

    def __init__(
        self,
        budget: int | None = None,
        every: int | None = None,
        observe: int = 32,
        kernel: int = 7,
        pooling: str = "max",
        beta: float = 20.0,
        layer: int | None = None,
        n_layers: int | None = None,
    ):
        super().__init__(budget, every)
        self.vote = WindowVote(observe, kernel, pooling)
        self.beta = check_beta(beta)
        self.layer, self.n_layers = check_place(layer, n_layers)
        self.always = observe  # sinks + max(window, observe), set at attach
        self._memo: tuple[Any, int] | None = None
        self._queries: mx.array | None = None  # (B, Hq, n <= observe, D), the newest queries
        self._q_end = 0  # absolute position just after the last buffered query
        self._scale: float | None = None

    def config(self) -> dict[str, Any]:
        return {**super().config(), **self.vote.config()}

    def attach(self, cache) -> None:
        super().attach(cache)
        self.always = cache.sinks + max(cache.window, self.vote.observe)
        if self.budget is not None and self.budget <= self.always:
            raise ValueError(
                f"budget={self.budget} must exceed sinks + max(window, observe) = "
                f"{self.always} (every layer keeps those tokens; the pyramid shares out the rest)"
            )

    # -- the place in the pyramid -----------------------------------------------------------
    def place(self, layer: int, n_layers: int) -> None:
        """Set the layer's place: ``0 <= layer < n_layers`` (0: the bottom, most tokens)."""
        self.layer, self.n_layers = check_place(layer, n_layers)
        self._memo = None

    def bind(self, model: Any = None, layer: int | None = None) -> None:
        """Place the layer among ``model``'s layers (``PyramidKVCache.link_layers`` refines it
        to the layers holding a PyramidKV cache). Without a model, ``n_layers`` must be set."""
        if layer is None:
            return
        check_int("layer", layer, minimum=0)
        if model is not None:
            self.place(layer, len(model.layers))
        elif self.n_layers is None:
            raise ValueError(
                f"pyramidkv: bind(None, {layer}) cannot tell how many layers share the pyramid; "
                "make the caches with velox_core.make_cache(model, ...) or give n_layers"
            )
        else:
            self.place(layer, self.n_layers)

    def layer_budget(self, seen: int) -> int:
        """Tokens this layer keeps per KV head once ``seen`` tokens have arrived."""
        if seen <= self.budget:
            return max(seen, self.always)  # below the average: no layer evicts, any place
        if self.layer is None:
            raise ValueError(
                "pyramidkv: this cache does not know its place in the pyramid (its budget "
                "depends on its layer); make the caches with velox_core.make_cache(model, ...), "
                "or give layer=i and n_layers=L to a cache made by hand"
            )
        key = (seen, self.layer, self.n_layers, self.always)
        if self._memo is None or self._memo[0] != key:
            b = layer_budget(self.budget, self.always, self.n_layers, self.beta, seen, self.layer)
            self._memo = (key, b)
        return self._memo[1]

    # -- when to cut ------------------------------------------------------------------------
    def before_update(self, cache, incoming: int) -> None:
        """Cut to the layer's budget after a prefill chunk, or with ``every`` during decode."""
        after_chunk, self._chunk_pending = self._chunk_pending, incoming > 1
        if self.budget is None:
            return
        size = cache.size()
        if not (after_chunk or self.every is not None):
            if not _WARNED[0] and size >= 2 * self.budget and self.layer is not None:
                _warn_unbounded(self, size, self.layer_budget(cache.offset))
            return
        target = self.layer_budget(cache.offset)
        over = size - target
        if over <= 0 or not (after_chunk or over >= self.every):
            return
        cache.evict(self.select(cache, max(target - cache.protected(), 0)))

    # -- the observation window's queries (as velox-snapkv) ---------------------------------
    def observe(self, cache, queries: mx.array, scale: float) -> None:
        """Keep the newest ``observe`` queries (they sit at the newest stored positions).

        Without ``every`` only chunks are kept (single decode queries never vote), and the
        queries are dropped after the cut they vote for, so decode holds no policy state.
        """
        if self.budget is None or (self.every is None and queries.shape[2] == 1):
            return
        w = self.vote.observe
        start = cache.offset - queries.shape[2]  # position of this call's first query
        new, old = queries[:, :, -w:], self._queries
        if old is not None and new.shape[2] < w and self._q_end >= start:
            before = start - (self._q_end - old.shape[2])  # buffered queries before `start`
            same = all(old.shape[i] == new.shape[i] for i in (0, 1, 3))
            if before > 0 and same:
                old = old[:, :, :before][:, :, -(w - new.shape[2]) :]
                new = mx.concatenate([old.astype(new.dtype), new], axis=2)
        self._queries = mx.contiguous(new)
        self._q_end = cache.offset
        self._scale = float(scale)
        mx.async_eval(self._queries)  # detach from the chunk's graph

    # -- choosing ---------------------------------------------------------------------------
    def score(self, cache) -> list[mx.array]:
        """Per KV head ``(B, T_h)``: pooled votes of the prefix, ``+inf`` for the window."""
        pos = cache.body_positions()
        if any(p is None for p in pos):
            return pos
        body_pos = mx.stack(pos, axis=1)  # (B, H, T)
        recent = body_pos >= cache.offset - self.vote.observe
        votes = self._votes(cache, body_pos)
        if votes is None and not cache.routed:
            raise ValueError(
                "pyramidkv: the observation window's queries vote for the tokens to keep, and "
                "only velox attention sees them: run the model inside "
                "velox_core.routed(model) (velox_core.generate does)"
            )
        if votes is None:  # routed, but no query has reached the cache yet: the most recent
            s = body_pos.astype(mx.float32)
        else:
            s = self.vote.pool(votes, body_pos, mx.logical_not(recent))
        s = mx.where(recent, mx.inf, s)
        return [s[:, h] for h in range(s.shape[1])]

    def select(self, cache, k: int):
        keep = super().select(cache, k)
        if self.every is None:
            self._queries = None  # no decode cuts: these queries will not vote again
        return keep

    def _votes(self, cache, body_pos: mx.array) -> mx.array | None:
        """Votes of the buffered queries for the body tokens ``(B, H, T)``, or None."""
        q = self._queries
        b, h, t = body_pos.shape
        if q is None or q.shape[0] != b:
            return None
        first = self._q_end - q.shape[2]  # position of the first buffered query
        seen = min(q.shape[2], cache.offset - first)  # queries trimmed away do not vote
        if seen <= 0:
            return None
        keys, _ = cache.keys_and_values()  # sinks | body | window, decoded
        n_sink = cache.sink_count()
        n_win = keys.shape[2] - n_sink - t
        sink_pos = mx.broadcast_to(mx.arange(n_sink, dtype=mx.int32), (b, h, n_sink))
        win_pos = mx.arange(cache.offset - n_win, cache.offset, dtype=mx.int32)
        k_pos = mx.concatenate(
            [sink_pos, body_pos.astype(mx.int32), mx.broadcast_to(win_pos, (b, h, n_win))], axis=2
        )
        q_pos = mx.arange(first, first + seen, dtype=mx.int32)
        votes = window_votes(q[:, :, :seen], q_pos, keys, k_pos, self._scale)
        return votes[:, :, n_sink : n_sink + t]

    # -- batch rows -------------------------------------------------------------------------
    def filter_batch(self, idx: mx.array) -> None:
        if self._queries is not None:
            self._queries = self._queries[idx]

    def extend_batch(self, other: PyramidKVPolicy) -> None:
        a, b = self._queries, other._queries
        if a is None or b is None or a.shape[1:] != b.shape[1:] or self._q_end != other._q_end:
            self._queries = None  # the windows disagree: vote again from the next queries
            return
        self._queries = mx.concatenate([a, b.astype(a.dtype)], axis=0)

    # -- state ------------------------------------------------------------------------------
    def state(self) -> dict[str, mx.array]:
        return {} if self._queries is None else {"queries": self._queries}

    def meta(self) -> Any:
        return {**super().meta(), "q_end": self._q_end, "scale": self._scale}

    def set_state(self, state: dict[str, mx.array], meta: Any) -> None:
        state = dict(state)
        queries = state.pop("queries", None)
        super().set_state(state, meta)
        meta = meta or {}
        self._queries = queries
        self._q_end = int(meta.get("q_end", 0))
        scale = meta.get("scale")
        self._scale = None if scale is None else float(scale)


def _warn_unbounded(policy: PyramidKVPolicy, size: int, target: int) -> None:
    """Once per process: without ``every``, decode tokens accumulate past the budget."""
    if _WARNED[0] or size < 2 * target:
        return
    _WARNED[0] = True
    warnings.warn(
        f"pyramidkv: the layer budget ({target} tokens, layer {policy.layer} of "
        f"{policy.n_layers}) bounds the prompt only, and decode tokens accumulate past it (now "
        f"{size} per KV head); pass every=N to cut again once a layer exceeds its budget by N",
        UserWarning,
        stacklevel=4,
    )
