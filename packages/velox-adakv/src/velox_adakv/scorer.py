"""The base scorer: SnapKV's observation-window vote (Li et al., arXiv 2404.14469).

SnapKV observes that the attention the last prompt tokens (the *observation window*) pay to
the context predicts which context tokens later queries will need. A token's score is the
attention weight the window's queries give it, softmax-normalized over everything each query
sees (causal), averaged over the window's queries and, for grouped-query attention, over the
query heads sharing the KV head; a max (or average) pooling over neighbouring positions then
keeps small clusters together. Ada-KV (arXiv 2407.11550) uses this score (its "Ada-SnapKV")
and compares it across heads: each head's weights are a distribution over the same context,
so they are comparable without further normalization.

velox keeps the last ``observe`` post-RoPE queries a layer attended with (through
:meth:`VeloxCache.attend`, i.e. routed attention) and their absolute positions, and scores
the stored body against them when an eviction is due. The softmax runs over every stored
token (sinks, body, window) a query may see. Deviations: after an earlier eviction the
context is the tokens still stored; after decode steps the window holds the latest queries
(decode ones included); pooling joins tokens within ``kernel // 2`` *positions* of each other
(the kept tokens are no longer contiguous). Before any query is observed (a cache filled by
hand) tokens are ranked by recency.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx

from velox_core.policy import WindowVote, window_votes

__all__ = ["ObservationWindow", "protected_keys"]


def protected_keys(view) -> tuple[mx.array | None, mx.array | None]:
    """Keys and absolute positions of the sinks and the window together (never evicted, but
    part of every query's softmax), from the view's ``protected()``.

    Shapes:
        returns float32 ``(B, H, P, D)`` and int32 ``(P,)``, or ``(None, None)``.
    """
    (sk, _, sp), (wk, _, wp) = view.protected()
    parts = [(k, p) for k, p in ((sk, sp), (wk, wp)) if k is not None]
    if not parts:
        return None, None
    keys = mx.concatenate([k for k, _ in parts], axis=2) if len(parts) > 1 else parts[0][0]
    pos = mx.concatenate([p for _, p in parts]) if len(parts) > 1 else parts[0][1]
    return keys.astype(mx.float32), pos.astype(mx.int32)


class ObservationWindow:
    """The last ``vote.observe`` queries a layer attended with, and the SnapKV vote they cast
    (:func:`velox_core.policy.window_votes`, averaged over the window's queries, pooled by
    ``vote``).
    """

    def __init__(self, vote: WindowVote):
        self.vote = vote
        self.size = vote.observe
        self.q: mx.array | None = None  # (B, Hq, W, D), as the model computes
        self.pos: list[int] = []  # absolute position of each kept query
        self.scale = 1.0

    def add(self, queries: mx.array, offset: int, scale: float) -> None:
        """Record the queries of one attention call (the newest ``L`` tokens, ending at
        ``offset``); stale queries at or after their positions (a trim) are dropped."""
        n = queries.shape[2]
        start = offset - n
        keep = sum(p < start for p in self.pos)
        if self.q is not None and (self.q.shape[:2], self.q.shape[3]) != (
            queries.shape[:2],
            queries.shape[3],
        ):
            keep = 0  # another batch or head layout: start over
        new = queries[:, :, -self.size :]
        q = new if keep == 0 else mx.concatenate([self.q[:, :, :keep], new], axis=2)
        pos = self.pos[:keep] + list(range(offset - new.shape[2], offset))
        self.q = mx.contiguous(q[:, :, -self.size :])
        self.pos = pos[-self.size :]
        self.scale = float(scale)

    def scores(self, view) -> list[mx.array | None]:
        """Per KV head, the pooled vote of the window for each body token: ``(B, T_h)``."""
        keys, positions = view.body_keys(), view.body_positions()
        if self.q is None:
            return [None if p is None else p.astype(mx.float32) for p in positions]
        pk, pp = protected_keys(view)
        qpos = mx.array(self.pos, dtype=mx.int32)  # (W,)
        r = self.q.shape[1] // len(keys)
        out = []
        for h, (k, p) in enumerate(zip(keys, positions)):
            if k is None:
                out.append(None)
                continue
            t = k.shape[2]
            every, every_pos = k, p  # (B, 1, T, D), (B, T): the body, then the protected keys
            if pk is not None:
                every = mx.concatenate([k.astype(mx.float32), pk[:, h : h + 1]], axis=2)
                every_pos = mx.concatenate([p, mx.broadcast_to(pp, (p.shape[0], pp.size))], -1)
            qh = self.q[:, h * r : (h + 1) * r]  # (B, R, W, D)
            votes = window_votes(qh, qpos, every, every_pos[:, None], self.scale)  # (B, 1, T + P)
            vote = votes[:, 0, :t] / qpos.size  # the mean over the window's queries
            out.append(self.vote.pool(vote, p))
        return out

    # -- state ---------------------------------------------------------------------------
    def state(self) -> dict[str, mx.array]:
        return {} if self.q is None else {"queries": self.q}

    def meta(self) -> dict[str, Any]:
        return {"positions": list(self.pos), "scale": self.scale}

    def set_state(self, state: dict[str, mx.array], meta: dict[str, Any]) -> None:
        extra = sorted(set(state) - {"queries"})
        if extra:
            raise ValueError(f"adakv: unexpected observation-window arrays {extra}")
        self.q = state.get("queries")
        self.pos = [int(p) for p in meta.get("positions", [])]
        self.scale = float(meta.get("scale", 1.0))
        if (self.q is None) != (not self.pos) or (
            self.q is not None and self.q.shape[2] != len(self.pos)
        ):
            raise ValueError("adakv: observation-window queries and positions disagree")

    def take_batch(self, idx: mx.array) -> None:
        """Keep the queries of the given batch rows (the cache was filtered)."""
        if self.q is not None:
            self.q = self.q[idx]

    def join_batch(self, other: ObservationWindow) -> None:
        """Append another cache's rows; windows of different positions cannot be joined,
        so both are dropped (scores fall back to recency until new queries arrive)."""
        if self.q is not None and other.q is not None and self.pos == other.pos:
            self.q = mx.concatenate([self.q, other.q], axis=0)
        else:
            self.q, self.pos = None, []
