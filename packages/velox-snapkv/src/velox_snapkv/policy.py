"""``SnapKVPolicy``: keep the prompt tokens the observation window votes for (arXiv 2404.14469).

SnapKV observes that each attention head keeps attending, during generation, to the prompt
tokens that the last few prompt tokens (the *observation window*) attend to. So it lets the
window vote: the window's attention weights over the prefix, summed over its queries
(:func:`velox_core.policy.window_votes`), pooled along the tokens so that neighbours come
along (:func:`velox_core.policy.pool_votes`); each head keeps its top ``budget - protected``
prefix tokens plus the window itself.

How it runs in velox: :meth:`SnapKVPolicy.observe` keeps the newest ``observe`` queries it
sees (post-RoPE, as ``VeloxCache.attend`` passes them, so only inside
``velox_core.routed(model)`` or ``velox_core.generate``). velox-core calls
:meth:`~velox_core.RetentionPolicy.before_update` before the tokens after a prefill chunk
are stored; it cuts to ``budget`` with :meth:`SnapKVPolicy.score`, which computes the votes
of the kept queries over the tokens stored at that moment (so votes never go stale through
evictions, appends or trims). The newest ``observe`` tokens score ``+inf``, so the
observation window is never evicted. The kept queries are the policy's state (saved with the
cache, counted in ``nbytes``); without ``every`` they are dropped after the cut they vote
for, so decode holds no policy state.

Deviations from the paper (also in docs/snapkv.md):

* **Chunked prefill.** The paper compresses once, after the whole prompt, with the prompt's
  last ``window_size`` queries. Here every prefill chunk is followed by a cut voted by that
  chunk's last ``observe`` queries over what is stored (earlier survivors plus the chunk),
  so peak memory stays at ``budget`` plus one chunk; a token evicted by an early chunk's
  window cannot come back for a later one. A prompt that fits in one chunk gets exactly
  the paper's rule. mlx-lm's ``generate`` feeds the last prompt token as a step of
  its own: the window then ends one token before the prompt's end, and that token attends
  to the compressed cache.
* **GQA.** The authors' code repeats the KV heads up to the query heads and selects per
  query head (storing the repeated KV); here the votes of the query heads sharing a KV head
  are averaged, and each KV head keeps one selection.
* **Decode.** The paper does not evict generated tokens; with ``every`` set, the cache is
  cut again every ``every`` decode steps, voted by the latest ``observe`` queries.
* **No observed queries**: without routing a cut raises (no query can ever vote); routed
  but before any query reached the cache, a cut keeps the most recent tokens.
* Votes are computed from the stored keys, i.e. from their codes when the kept tokens are
  quantized; learned per-head sink logits (gpt-oss) are not part of the vote's softmax.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx

from velox_core import RetentionPolicy
from velox_core.policy import WindowVote, window_votes

__all__ = ["SnapKVPolicy"]


class SnapKVPolicy(RetentionPolicy):
    """SnapKV's retention policy.

    Args:
        budget: tokens kept per KV head (sinks, voted prefix and window), or None.
        every: during decode, cut again once the cache holds ``budget + every`` tokens
            (None: only after prefill chunks, as the paper).
        observe: size of the observation window (queries that vote, newest tokens kept).
        kernel: odd pooling kernel size along tokens (1: no pooling).
        pooling: ``"max"`` or ``"avg"``.
    """

    name = "snapkv"

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
        self._queries: mx.array | None = None  # (B, Hq, n <= observe, D), the newest queries
        self._q_end = 0  # absolute position just after the last buffered query
        self._scale: float | None = None

    def config(self) -> dict[str, Any]:
        return {**super().config(), **self.vote.config()}

    def attach(self, cache) -> None:
        super().attach(cache)
        if self.budget is not None and self.budget <= cache.sinks + self.vote.observe:
            raise ValueError(
                f"budget={self.budget} must exceed sinks + observe = "
                f"{cache.sinks + self.vote.observe} (the observation window is always kept)"
            )

    # -- the observation window's queries ---------------------------------------------------
    def observe(self, cache, queries: mx.array, scale: float) -> None:
        """Keep the newest ``observe`` queries (they sit at the newest stored positions).

        Without ``every`` only chunks are kept (single decode queries never vote), and the
        queries are dropped after the cut they vote for, so decode holds no policy state.
        """
        if self.budget is None or (self.every is None and queries.shape[2] == 1):
            return  # no cut will use these queries (none, or none before the next chunk)
        total = queries.shape[2]
        start = cache.offset - total  # position of this call's first query
        new = queries[:, :, -self.vote.observe :]
        old = self._queries
        if old is not None and new.shape[2] < self.vote.observe:
            keep = start - (self._q_end - old.shape[2])  # buffered queries before `start`
            same = all(old.shape[i] == new.shape[i] for i in (0, 1, 3))
            if self._q_end >= start and keep > 0 and same:
                old = old[:, :, :keep][:, :, -(self.vote.observe - new.shape[2]) :]
                new = mx.concatenate([old.astype(new.dtype), new], axis=2)
        self._queries = mx.contiguous(new)
        self._q_end = cache.offset
        self._scale = float(scale)
        mx.async_eval(self._queries)  # detach from the chunk's graph (no growing chain)

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
                "snapkv: the observation window's queries vote for the tokens to keep, and "
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
        q, q_pos = q[:, :, :seen], mx.arange(first, first + seen, dtype=mx.int32)
        keys, _ = cache.keys_and_values()  # sinks | body | window, decoded
        n_sink = cache.sink_count()
        n_win = keys.shape[2] - n_sink - t
        k_pos = mx.concatenate(
            [
                mx.broadcast_to(mx.arange(n_sink, dtype=mx.int32), (b, h, n_sink)),
                body_pos.astype(mx.int32),
                mx.broadcast_to(
                    mx.arange(cache.offset - n_win, cache.offset, dtype=mx.int32), (b, h, n_win)
                ),
            ],
            axis=2,
        )
        votes = window_votes(q, q_pos, keys, k_pos, self._scale)
        return votes[:, :, n_sink : n_sink + t]

    # -- batch rows (called by SnapKVCache.filter / extend) ---------------------------------
    def filter_batch(self, idx: mx.array) -> None:
        if self._queries is not None:
            self._queries = self._queries[idx]

    def extend_batch(self, other: SnapKVPolicy) -> None:
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
