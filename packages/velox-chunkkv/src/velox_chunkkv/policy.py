"""``ChunkKVPolicy``: keep whole chunks of consecutive tokens (arXiv 2502.00299).

ChunkKV (Liu et al.) observes that token-level eviction (H2O, SnapKV) keeps the individually
best-scored tokens and drops the words around them, so a kept fact loses its subject or its
verb. It keeps *chunks* instead: the context is cut into chunks of ``chunk_length``
consecutive tokens, the observation window (the newest ``observe`` queries) scores every
token by its attention, a chunk scores the mean of its tokens' scores, and the best chunks
are kept whole until the budget is met; the window itself is always kept. Because whole
chunks are kept, adjacent layers keep much the same tokens, and the paper's *layer-wise
index reuse* lets a layer keep the chunks an earlier layer chose instead of choosing its own.

How it runs in velox: the votes are velox-core's SnapKV votes
(:class:`~velox_core.policy.WindowVotePolicy`, which this policy is: the softmax weights of
the buffered window queries over the stored tokens, summed over the window, averaged over
the query heads of each KV head, optionally pooled with ``kernel``); only the selection
differs. :meth:`ChunkKVPolicy.select` sums the votes over the layer's KV heads (kvpress's
``ChunkKVPress`` sums its scorer's scores over the heads: every head keeps the same chunks)
and hands them to :func:`~velox_chunkkv.select_chunks`, chunks being ranges of absolute
positions. Cuts come when SnapKV's do: after each prefill chunk (and, with ``every``, during
decode), before the next tokens are stored.

Layer-wise index reuse: ``ChunkKVCache.link_layers`` (called by ``make_cache`` and
``load_cache``) groups the ChunkKV layers in runs of ``reuse``; the first layer of a run (its
*leader*) chooses, and records the absolute positions it kept; the others (its *followers*)
run after it in the same forward pass and, when their cut comes at the same ``offset``, keep
exactly those positions without computing votes. The record is dropped once every follower
has used it (or at the leader's next update). A follower whose body does not hold those
positions (a cache made or fed apart from its leader) chooses on its own, as a leader would:
reuse never keeps anything but whole chunks within the budget.

Deviations (also in docs/chunkkv.md): SnapKV's in velox (chunked prefill, GQA votes averaged
per KV head, optional decode cuts, a cut refused without routing), chunks anchored at absolute
positions, batch rows equalized, and the budget counted in tokens rather than chunks.
"""

from __future__ import annotations

import mlx.core as mx

from velox_core.policy import WindowVotePolicy

from .chunks import select_chunks
from .config import check_chunk_length, check_room

__all__ = ["ChunkKVPolicy"]


class ChunkKVPolicy(WindowVotePolicy):
    """ChunkKV's retention policy: every KV head of the layer keeps the same whole chunks.

    Args:
        budget: tokens kept per KV head (sinks, kept chunks and window), or None.
        every: during decode, cut again once the cache holds ``budget + every`` tokens
            (None: only after prefill chunks, as the paper).
        observe: size of the observation window (queries that vote, newest tokens kept).
        kernel: odd pooling kernel along tokens, applied to the votes before the chunks
            average them (1: none, the paper's Algorithm 1).
        pooling: ``"max"`` or ``"avg"``.
        chunk_length: consecutive tokens per chunk.

    Attributes:
        leader: the policy whose kept positions this one reuses (set by
            ``ChunkKVCache.link_layers``), or None.
        followers: how many policies reuse this one's kept positions.
        selected, reused: cuts this policy chose itself, and cuts it took from its leader.
    """

    name = "chunkkv"
    settings = ("chunk_length",)

    def __init__(
        self,
        budget: int | None = None,
        every: int | None = None,
        observe: int = 32,
        kernel: int = 1,
        pooling: str = "max",
        chunk_length: int = 10,
    ):
        super().__init__(budget, every, observe, kernel, pooling)
        self.chunk_length = check_chunk_length(chunk_length)
        self.leader: ChunkKVPolicy | None = None
        self.followers = 0
        self.selected = 0
        self.reused = 0
        # the leader's last cut, for its followers: (offset, kept positions (B, n), pending)
        self._record: list | None = None

    def attach(self, view) -> None:
        super().attach(view)
        if self.budget is not None:
            check_room(
                self.budget, view.sinks + max(view.window, self.vote.observe), self.chunk_length
            )

    # -- layer-wise index reuse ---------------------------------------------------------------
    def follow(self, leader: ChunkKVPolicy | None) -> None:
        """Reuse ``leader``'s kept positions (None: choose on its own)."""
        if self.leader is not None:
            self.leader.followers -= 1
        self.leader = leader
        if leader is not None:
            leader.followers += 1

    def _take_record(self, view, k: int) -> mx.array | None:
        """The leader's kept positions as indices into this cache's body, or None when they do
        not apply (no leader, no record at this offset, other rows, positions not all here)."""
        lead = self.leader
        rec = None if lead is None else lead._record
        if rec is None or rec[0] != view.offset:
            return None
        rec[2] -= 1
        if rec[2] <= 0:
            lead._record = None  # every follower has used it
        kept = rec[1]
        pos = view.body_positions()
        if any(p is None for p in pos) or kept.shape[0] != pos[0].shape[0] or kept.shape[1] > k:
            return None
        body = pos[0]  # every head holds the same positions (the same chunks are kept)
        b, t = body.shape
        mark = mx.zeros((b, view.offset), dtype=mx.bool_)
        mark = mx.put_along_axis(mark, kept, mx.array(True), axis=1)
        member = mx.take_along_axis(mark, body, axis=1)
        if not mx.all(mx.sum(member, axis=1) == kept.shape[1]).item():
            return None
        idx = mx.arange(t, dtype=mx.int32)
        return mx.argsort(mx.where(member, idx, idx + t), axis=1)[:, : kept.shape[1]]

    # -- choosing ---------------------------------------------------------------------------
    def select(self, view, k: int):
        """Indices of the body tokens to keep, ``(B, H, n)`` with ``n <= k``: the leader's
        kept positions where they apply, else the observation window and the best chunks."""
        pos = view.body_positions()
        heads = len(pos)
        if any(p is None for p in pos):
            return mx.zeros((view.batch, heads, 0), dtype=mx.int32)
        keep = self._take_record(view, k)
        if keep is not None:
            self.reused += 1
        else:
            scores = mx.stack(self.score(view), axis=1)  # (B, H, T), +inf in the window
            body = pos[0]
            always = body >= view.offset - self.vote.observe
            summed = mx.sum(mx.where(always[:, None], 0.0, scores), axis=1)
            keep = select_chunks(summed, body, always, self.chunk_length, k)
            self.selected += 1
        if self.followers > 0:
            kept = mx.take_along_axis(pos[0], keep, axis=1)
            self._record = [view.offset, kept, self.followers]
        if self.every is None:
            self.window.clear()  # no decode cuts: these queries will not vote again
        b, n = keep.shape
        return mx.broadcast_to(keep[:, None, :], (b, heads, n))

    def before_update(self, view, incoming: int) -> None:
        """SnapKV's cadence; a leader's record of an earlier update is dropped first."""
        self._record = None
        super().before_update(view, incoming)

    # -- batch rows (called by VeloxCache.filter / extend) ----------------------------------
    def filter_batch(self, idx: mx.array) -> None:
        self._record = None
        super().filter_batch(idx)

    def extend_batch(self, other: WindowVotePolicy) -> None:
        self._record = None
        super().extend_batch(other)
