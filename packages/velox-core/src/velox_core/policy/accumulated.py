"""Accumulated votes: keep the recent tokens and the tokens every query so far voted for most
(velox-h2o's policy, and velox-keyformer's with Gumbel-perturbed votes).

:class:`AccumulatedPolicy` keeps one float32 score per stored token and KV head, ``(B, H,
S)``, in the cache's storage order (sinks, body, window). The tokens an ``update_and_fetch``
stores start at zero (:meth:`~AccumulatedPolicy.after_update`); :meth:`~AccumulatedPolicy.
observe`, called by ``VeloxCache.attend`` with the layer's post-RoPE queries before attention
(so only inside ``velox_core.routed(model)`` or ``velox_core.generate``), adds each query's
votes over every stored token, a block of queries at a time so that at most
:attr:`~AccumulatedPolicy.score_elements` weights exist at once. A cut keeps, per KV head,
the ``recent`` newest tokens (the cache's ``window`` counts among them) and the top of the
rest by accumulated score; the kept tokens keep their scores. Tokens no query has voted on
(stored without routed attention) rank above every scored token, the newest first; a cut
that meets them raises unless the cache is routed. A trim drops the trimmed tokens' scores.

A subclass gives the votes (:meth:`~AccumulatedPolicy.votes`: the ``(B, H, S)`` float32
votes of one block of queries, and where they are a function of the attention weights,
:meth:`~AccumulatedPolicy.weight_votes`: then a decode step's votes come from the weights its
attention computed, not from scoring its queries again beside it) and may act at the start
of each call (:meth:`~AccumulatedPolicy.begin`, with the call's query count); it adds its
own arrays and scalars to the state through ``super()`` (:meth:`state`, :meth:`meta`,
:meth:`set_state`).

State: ``{"scores": (B, H, S) float32}`` (absent before the first tokens); meta adds
``seen`` (every stored token before this position has been voted on) to the base policy's.

Two pieces a method mixes in before it: :class:`AttentionVotes`, votes that are each query's
attention weights (velox-h2o, velox-cam), and :class:`SeededDraws`, random draws from a key
seeded per layer and saved with the scores (velox-cam's merge masks, velox-keyformer's
Gumbel noise).
"""

from __future__ import annotations

import functools
from typing import Any, ClassVar

import mlx.core as mx

from ..validation import check_int
from .base import RetentionPolicy, require_routed, top_k_sorted
from .votes import fuse_weights, window_votes

__all__: list[str] = []

# votes formed at once by default when a call's queries are scored
SCORE_ELEMENTS = 1 << 20


class AccumulatedPolicy(RetentionPolicy):
    """Accumulated votes per KV head, plus a recent window (abstract: see :meth:`votes`).

    Args:
        budget: tokens kept per KV head (sinks, top-scored tokens, recent tokens), or None.
        every: during decode, cut once the cache holds ``budget + every`` tokens (1: one
            token per step; None: only after prefill chunks).
        recent: the newest tokens always kept, in tokens; the cache's ``window`` counts
            among them.
    """

    name = "accumulated"
    settings = ("recent",)
    # what the attach error calls the tokens kept beyond sinks and recent ones
    kept_name: ClassVar[str] = "top-scored token"

    def __init__(self, budget: int | None = None, every: int | None = 1, recent: int = 0):
        super().__init__(budget, every)
        self.recent = check_int("recent", recent, minimum=0)
        self._scores: mx.array | None = None  # (B, H, S) float32, in the cache's order
        self._seen = 0  # every stored token before this position has been voted on

    # -- the hooks a method gives -------------------------------------------------------------
    def votes(
        self, queries: mx.array, q_pos: mx.array, keys: mx.array, k_pos: mx.array, scale: float
    ) -> mx.array:
        """The votes one block of queries adds to the scores.

        Called by :meth:`observe` once per block, in order (the blocks of a call cover its
        queries, oldest first); a query votes only for the tokens it can see (``k_pos <=``
        its position), and its votes for the others must be zero.

        Args:
            queries: the block's post-RoPE queries; the query heads of KV head ``h`` are
                ``h * R ... h * R + R - 1`` (mlx-lm's grouped layout).
            q_pos: absolute positions of the block's queries.
            keys: every stored key, decoded, in storage order.
            k_pos: absolute position of each stored key.
            scale: the model's attention scale.

        Shapes:
            queries ``(B, Hq, n, D)``, q_pos int32 ``(n,)``, keys ``(B, H, S, D)``, k_pos
            int32 ``(B, H, S)``; returns float32 ``(B, H, S)``.
        """
        raise NotImplementedError(f"{self.name}: a subclass gives the votes")

    def weight_votes(self, weights: mx.array, q_pos: mx.array) -> mx.array | None:
        """The votes of one call's queries from the attention weights the call computed, or
        None (the default: this policy's votes are not a function of them, and
        :meth:`votes` scores the queries beside the call). Called by
        :meth:`observe_weights`, after :meth:`begin`; a query's weights on tokens it cannot
        see are zero.

        Args:
            weights: each query's softmax weights over every stored token, in storage order.
            q_pos: absolute positions of the call's queries.

        Shapes:
            weights float32 ``(B, H, R, n, S)`` (``R`` query heads a KV head), q_pos int32
            ``(n,)``; returns float32 ``(B, H, S)``.
        """
        return None

    def begin(self, n: int) -> None:
        """Called at the start of every :meth:`observe` that scores (a budget is set), after
        the scores are aligned with the stored tokens and before the first block's
        :meth:`votes`, with the call's query count ``n`` (1: a decode step)."""

    @property
    def score_elements(self) -> int:
        """The most votes formed at once: a call's queries are scored in blocks of
        ``score_elements // (B * Hq * stored tokens)`` (at least one)."""
        return SCORE_ELEMENTS

    # -- the hooks the cache calls -----------------------------------------------------------
    def attach(self, view) -> None:
        super().attach(view)
        always = view.sinks + max(view.window, self.recent)
        if self.budget is not None and self.budget <= always:
            raise ValueError(
                f"budget={self.budget} must exceed sinks + max(window, recent) = {always} "
                f"(those tokens are always kept, and at least one {self.kept_name} must fit)"
            )

    # -- the scores follow the stored tokens -------------------------------------------------
    def _sync(self, view) -> None:
        """Align the scores with the stored tokens: a trim drops the newest stored tokens
        (the last of the storage order), and their scores with them."""
        n = view.size()
        if self._scores is None:
            if n:
                raise ValueError(f"{self.name}: the cache stores {n} tokens but holds no scores")
            return
        s = self._scores.shape[2]
        if n < s:
            self._scores = self._scores[:, :, :n]
        elif n > s:
            raise ValueError(f"{self.name}: the scores cover {s} tokens, the cache stores {n}")
        self._seen = min(self._seen, view.offset)

    def before_update(self, view, incoming: int) -> None:
        if self.budget is not None:
            self._sync(view)
        super().before_update(view, incoming)

    def after_update(self, view, start: int) -> None:
        """The tokens just stored start with a score of zero."""
        if self.budget is None:
            return
        new = _zero_scores(view.batch, view.kv_heads, view.offset - start)
        old = self._scores
        self._scores = new if old is None else mx.concatenate([old, new], axis=2)

    # -- accumulating ------------------------------------------------------------------------
    def observe(self, view, queries: mx.array, scale: float) -> None:
        """Add the votes of this call's queries (the newest stored positions) over every
        stored token to the scores, in blocks of queries (:meth:`votes`)."""
        if self.budget is None:
            return
        self._sync(view)
        b, hq, n, _ = queries.shape
        self.begin(n)
        keys, _ = view.keys_and_values()  # sinks | body | window, decoded: (B, H, S, D)
        k_pos = self._stored_positions(view)
        first = view.offset - n  # position of this call's first query
        block = max(1, self.score_elements // max(1, b * hq * keys.shape[2]))
        acc = self._scores
        for i in range(0, n, block):
            j = min(i + block, n)
            q_pos = mx.arange(first + i, first + j, dtype=mx.int32)
            acc = acc + self.votes(queries[:, :, i:j], q_pos, keys, k_pos, scale)
            if j < n:
                mx.eval(acc)  # one block's votes at a time
        self._keep(view, acc)

    def wants_weights(self, n: int) -> bool:
        """Whether this policy's votes come from the call's attention weights
        (:meth:`weight_votes` gives them): a budget is set and a subclass defines them."""
        return self.budget is not None and type(self).weight_votes is not (
            AccumulatedPolicy.weight_votes
        )

    def observe_weights(self, view, queries: mx.array, scale: float, weights: mx.array) -> None:
        """Add the votes :meth:`weight_votes` makes of this call's attention weights."""
        if not self.wants_weights(queries.shape[2]):
            self.observe(view, queries, scale)
            return
        self._sync(view)
        n = queries.shape[2]
        self.begin(n)
        q_pos = mx.arange(view.offset - n, view.offset, dtype=mx.int32)
        # a full cache is cut within `every` steps, and the cut evaluates the scores with its
        # step's graph (a chain of at most `every` steps' votes); otherwise they are
        # evaluated now, not chained through the steps until a cut (on a GPU an evaluation
        # a layer and step is host time the step waits for)
        detach = self.every is None or view.size() < self.budget
        self._keep(view, self._scores + self.weight_votes(weights, q_pos), detach)

    def _keep(self, view, scores: mx.array, detach: bool = True) -> None:
        """Hold the scores updated by every query up to the newest stored position;
        ``detach``: evaluate them now (asynchronously), apart from the call's graph."""
        self._scores = scores
        self._seen = view.offset
        if detach:
            mx.async_eval(*self.state().values())

    @staticmethod
    def _stored_positions(view) -> mx.array:
        """Absolute position of every stored token, in storage order: int32 ``(B, H, S)``."""
        b, h = view.batch, view.kv_heads
        n_sink = view.sink_count()
        parts = [mx.broadcast_to(mx.arange(n_sink, dtype=mx.int32), (b, h, n_sink))]
        body, t = view.body_positions(joined=True), 0
        if body is not None:
            parts.append(body.astype(mx.int32))
            t = body.shape[2]
        n_win = view.size() - n_sink - t
        win = mx.arange(view.offset - n_win, view.offset, dtype=mx.int32)
        parts.append(mx.broadcast_to(win, (b, h, n_win)))
        return mx.concatenate(parts, axis=2)

    # -- choosing ----------------------------------------------------------------------------
    def score(self, view) -> list[mx.array | None]:
        """Per KV head ``(B, T)`` float32: each body token's accumulated score; the recent
        tokens ``+inf``; tokens no query has voted on above every scored token, the newest
        highest."""
        pos = view.body_positions()
        if any(p is None for p in pos):
            return pos
        s = self._body_scores(view, mx.stack(pos, axis=1))
        return [s[:, h] for h in range(s.shape[1])]

    def _body_scores(self, view, body_pos: mx.array) -> mx.array:
        self._sync(view)
        why = "the votes every query gives each token choose the tokens to keep"
        self._check_routed(view, why)
        s = acc = self._body_part(view.sink_count(), body_pos.shape[2])
        if self._seen < view.offset:  # (a decode step's cut: every stored token voted on)
            unseen = body_pos >= self._seen
            above = mx.max(acc, axis=2, keepdims=True) + 1.0  # above every accumulated score
            s = mx.where(unseen, above + (body_pos - self._seen).astype(mx.float32), acc)
        return mx.where(body_pos >= view.offset - self.recent, mx.inf, s)

    def _body_replaced(self, n_sink: int, t: int, body: mx.array) -> mx.array:
        """The scores with their ``t`` body scores after the ``n_sink`` sinks' replaced by
        ``body`` (``(B, H, t')``): the sinks', ``body``, the window's (those that exist)."""
        acc = self._scores
        parts = [acc[:, :, :n_sink]] if n_sink else []
        parts.append(body)
        if n_sink + t < acc.shape[2]:
            parts.append(acc[:, :, n_sink + t :])
        return parts[0] if len(parts) == 1 else mx.concatenate(parts, axis=2)

    def _body_part(self, n_sink: int, t: int) -> mx.array:
        """The body tokens' scores: ``(B, H, t)`` after the ``n_sink`` sinks' (the scores
        themselves where the body is every stored token)."""
        acc = self._scores
        return acc if n_sink == 0 and t == acc.shape[2] else acc[:, :, n_sink : n_sink + t]

    def _check_routed(self, view, why: str) -> None:
        """Raise unless every stored token has been voted on or the cache is routed (its
        queries reach :meth:`observe`); ``why`` says what the votes decide."""
        if view.offset > self._seen:
            require_routed(view, self.name, why)

    def select(self, view, k: int):
        """The top ``k`` body tokens per KV head, ``(B, H, k)``; their scores are kept."""
        body_pos = view.body_positions(joined=True)
        if body_pos is None:
            return mx.zeros((view.batch, view.kv_heads, 0), dtype=mx.int32)
        idx = top_k_sorted(self._body_scores(view, body_pos), k)
        n_sink, t = view.sink_count(), body_pos.shape[2]
        kept = mx.take_along_axis(self._body_part(n_sink, t), idx, axis=2)
        self._scores = self._body_replaced(n_sink, t, kept)
        return idx

    # -- batch rows (called by VeloxCache.filter / extend) -------------------------------------
    def filter_batch(self, idx: mx.array) -> None:
        if self._scores is not None:
            self._scores = self._scores[idx]

    def extend_batch(self, other: AccumulatedPolicy) -> None:
        a, b = self._scores, other._scores
        if a is None and b is None:
            return
        if a is None or b is None or a.shape[1:] != b.shape[1:]:
            raise ValueError(f"{self.name}: extend needs caches whose scores cover the same tokens")
        self._scores = mx.concatenate([a, b], axis=0)
        self._seen = min(self._seen, other._seen)  # tokens unseen by a row count as unseen

    # -- state: {"scores": (B, H, S) float32}, meta "seen" -------------------------------------
    def state(self) -> dict[str, mx.array]:
        return {} if self._scores is None else {"scores": self._scores}

    def meta(self) -> Any:
        return {**super().meta(), "seen": self._seen}

    def _check_scores(self, scores: mx.array | None) -> None:
        """Raise unless ``scores`` is None or float32 ``(B, H, S)``."""
        if scores is not None and (scores.ndim != 3 or scores.dtype != mx.float32):
            raise ValueError(
                f"{self.name}: the accumulated scores must be float32 (B, H, S), got "
                f"{scores.dtype} {tuple(scores.shape)}"
            )

    def set_state(self, state: dict[str, mx.array], meta: Any) -> None:
        """Restore the scores and ``seen``; a subclass pops its own arrays from ``state``
        (and checks them) before calling this (which refuses any array left over)."""
        state = dict(state)
        scores = state.pop("scores", None)
        self._check_scores(scores)
        super().set_state(state, meta)
        self._scores = scores
        self._seen = int((meta or {}).get("seen", 0))


class AttentionVotes(AccumulatedPolicy):
    """Votes that are attention weights: each query's softmax weights over every stored
    token, summed over the queries and averaged over the query heads of each KV head
    (:func:`~velox_core.policy.votes.window_votes`); a decode step's come from the weights
    its attention computed (:func:`~velox_core.policy.votes.fuse_weights`, the same rule)."""

    def votes(
        self, queries: mx.array, q_pos: mx.array, keys: mx.array, k_pos: mx.array, scale: float
    ) -> mx.array:
        """The block's softmax weights over every stored token (:func:`window_votes`)."""
        return window_votes(queries, q_pos, keys, k_pos, scale)

    def weight_votes(self, weights: mx.array, q_pos: mx.array) -> mx.array:
        """A decode step's votes: the weights its attention computed, summed over its
        queries and averaged over the query heads of each KV head (:func:`window_votes`'s
        rule, :func:`~velox_core.policy.votes.fuse_weights`)."""
        return fuse_weights(weights)


@functools.lru_cache(maxsize=8)
def _zero_scores(b: int, h: int, n: int) -> mx.array:
    """The scores of ``n`` tokens just stored, zero: float32 ``(b, h, n)`` (made once for a
    decode step's shape)."""
    return mx.zeros((b, h, n), dtype=mx.float32)


def layer_key(seed: int, layer: int | None) -> mx.array:
    """The first key of one layer's draws: the ``layer``-th of ``seed``'s split keys (layer
    None: the first)."""
    i = layer or 0
    return mx.random.split(mx.random.key(seed), i + 1)[i]


class SeededDraws(AccumulatedPolicy):
    """Random draws from a key seeded per layer: each draw splits the key, keeps one half and
    draws from the other (:meth:`next_key`), so a run and the same run resumed after loading
    draw alike. A subclass calls :meth:`start_draws` with its ``seed`` at the end of its
    ``__init__``; ``key_name`` names the key in errors.

    State: adds ``{"key": uint32 (2,)}`` once there are scores; meta adds ``draws`` (the
    draws so far; until the first, :meth:`bind` gives each layer its own key).
    """

    key_name: ClassVar[str] = "draws' key"

    def start_draws(self, seed: int) -> None:
        """Check ``seed`` (an int >= 0) and start the draws from its first key."""
        self.seed = check_int("seed", seed, minimum=0)
        self._key = layer_key(self.seed, None)
        self._draws = 0

    def bind(self, model: Any = None, layer: int | None = None) -> None:
        if self._draws == 0:  # each layer its own draws
            self._key = layer_key(self.seed, layer)

    def next_key(self) -> mx.array:
        """The key of the next draw: the key is split, one half kept, the other returned."""
        keys = mx.random.split(self._key)
        self._key, self._draws = keys[0], self._draws + 1
        return keys[1]

    def state(self) -> dict[str, mx.array]:
        # an empty cache holds nothing: the key is saved with the first scores
        state = super().state()
        return {**state, "key": self._key} if state else state

    def meta(self) -> Any:
        return {**super().meta(), "draws": self._draws}

    def set_state(self, state: dict[str, mx.array], meta: Any) -> None:
        state = dict(state)
        key, scores = state.pop("key", None), state.get("scores")
        self._check_scores(scores)  # the scores' error first, then the key's
        if scores is not None and (key is None or key.shape != (2,) or key.dtype != mx.uint32):
            got = None if key is None else f"{key.dtype} {tuple(key.shape)}"
            raise ValueError(f"{self.name}: the {self.key_name} must be uint32 (2,), got {got}")
        super().set_state(state, meta)
        self._key = layer_key(self.seed, None) if key is None else key
        self._draws = int((meta or {}).get("draws", 0))
