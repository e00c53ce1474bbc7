"""SnapKV-style voting: keep the body tokens an observation window votes for (velox-snapkv's
policy, and velox-pyramidkv's under per-layer budgets).

:class:`WindowVotePolicy` buffers the newest ``observe`` post-RoPE queries of its layer
(:class:`~velox_core.policy.window.QueryWindow`). A cut scores each body token, per KV head,
by the pooled votes of those queries over the tokens stored at that moment
(:func:`~velox_core.policy.votes.window_votes`, then
:func:`~velox_core.policy.votes.pool_votes` over the tokens outside the window); the newest
``observe`` positions (the observation window) score ``+inf``, so they are never evicted.
The top ``budget - protected`` per KV head stay (:meth:`RetentionPolicy.select
<velox_core.policy.base.RetentionPolicy.select>`).

Without ``every`` no decode cut follows the prompt: single decode queries are not buffered
and the queries are dropped after the cut they vote for, so decode holds no policy state.
Without routed attention no query ever reaches the policy and a cut raises; routed but
before any query arrived, a cut keeps the most recent tokens.

State: ``{"queries": (B, Hq, n <= observe, D)}`` (absent once dropped); meta adds ``q_end``
(absolute position after the newest query) and ``scale`` to the base policy's.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx

from .base import RetentionPolicy, require_routed
from .votes import WindowVote
from .window import QueryWindow, WindowState

__all__: list[str] = []

# WindowVotePolicy's parameters: an eviction cache's ``policy_params`` for it, or their start
VOTE_PARAMS = ("budget", "every", "observe", "kernel", "pooling")


class WindowVotePolicy(WindowState, RetentionPolicy):
    """Keep what the newest ``observe`` queries vote for, per KV head.

    Args:
        budget: tokens kept per KV head (sinks, voted body and window), or None.
        every: during decode, cut again once the cache holds ``budget + every`` tokens
            (None: only after prefill chunks).
        observe: size of the observation window (queries that vote, newest tokens kept).
        kernel: odd pooling kernel size along tokens (1: no pooling).
        pooling: ``"max"`` or ``"avg"``.
    """

    name = "window-vote"

    def __init__(
        self,
        budget: int | None = None,
        every: int | None = None,
        observe: int = 32,
        kernel: int = 7,
        pooling: str = "max",
    ):
        super().__init__(budget, every)
        self.vote = WindowVote(observe, kernel, pooling)
        self.window = QueryWindow(self.vote.observe)

    def config(self) -> dict[str, Any]:
        return {**super().config(), **self.vote.config()}

    def attach(self, view) -> None:
        super().attach(view)
        if self.budget is not None and self.budget <= view.sinks + self.vote.observe:
            raise ValueError(
                f"budget={self.budget} must exceed sinks + observe = "
                f"{view.sinks + self.vote.observe} (the observation window is always kept)"
            )

    def observe(self, view, queries: mx.array, scale: float) -> None:
        """Buffer the newest ``observe`` queries (:meth:`QueryWindow.add`); without ``every``
        single decode queries are skipped (no cut will use them)."""
        if self.budget is None or (self.every is None and queries.shape[2] == 1):
            return
        self.window.add(view, queries, scale)

    # -- choosing ---------------------------------------------------------------------------
    def score(self, view) -> list[mx.array]:
        """Per KV head ``(B, T_h)``: pooled votes of the prefix, ``+inf`` for the window."""
        pos = view.body_positions()
        if any(p is None for p in pos):
            return pos
        body_pos = mx.stack(pos, axis=1)  # (B, H, T)
        recent = body_pos >= view.offset - self.vote.observe
        votes = self.window.votes(view, body_pos)
        if votes is None:  # no query has reached the cache (refused unless routed): the newest
            require_routed(view, self.name, "the observation window votes for the tokens to keep")
            s = body_pos.astype(mx.float32)
        else:
            s = self.vote.pool(votes, body_pos, mx.logical_not(recent))
        s = mx.where(recent, mx.inf, s)
        return [s[:, h] for h in range(s.shape[1])]

    def select(self, view, k: int):
        keep = super().select(view, k)
        if self.every is None:
            self.window.clear()  # no decode cuts: these queries will not vote again
        return keep

    # batch rows and state: WindowState
