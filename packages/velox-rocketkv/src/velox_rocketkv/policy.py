"""``RocketKVPolicy``: SnapKV++ eviction, then hybrid sparse attention at decode
(arXiv 2502.14051).

**Stage 1, SnapKV++** (permanent eviction). The observation window (the newest ``observe``
queries) votes for the tokens it attends, the votes are max-pooled over ``kernel`` positions
so that neighbours come along, and each KV head keeps its best-voted tokens and the window.
SnapKV++ differs from SnapKV in two ways, both velox-core's
:class:`~velox_core.policy.WindowVotePolicy` settings here: GQA compatibility (the votes of
the query heads sharing a KV head are aggregated and that KV head keeps one selection, instead
of the KV heads repeated to the query heads and stored per query head), and the pooling size
(63, the authors' code for every benchmark, where SnapKV's is 7).

**Stage 2, hybrid sparse attention** (:mod:`velox_rocketkv.sparse`). At each decode step the
kept tokens are scored approximately from their page summaries (:mod:`velox_rocketkv.pages`)
and the query's largest channels, and the step attends exactly only the ``topk`` best per KV
head: velox-core asks :meth:`RocketKVPolicy.decode_segments` which tokens a single-query
call attends, and this policy answers with the sinks, the selected body tokens (gathered from
their codes) and the window. The summaries are kept in step with the body and are this
policy's state (counted in the cache's bytes, saved with it).

**The budget.** ``budget`` counts, per KV head, the sinks, the window, the kept body tokens and
the page summaries, each summary at its bytes over a kept token's (a minimum and a maximum key
in the storage dtype: one token's worth for fp16 keys and values of equal width, about 3.2
for 4-bit codes), so the layer's bytes stay within the budget's tokens' bytes: a cut keeps
:func:`~velox_rocketkv.split.body_capacity` body tokens (768 of ``budget=1024`` in fp16 with
3-token pages, their 256 summaries the rest; 495 with ``bits=4, group=32``). Cuts come as
SnapKV's do (after each prefill chunk, or once at the prompt's end with ``prefill="prompt"``;
with ``every``, again during decode).
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx

from velox_core.cache.attention import Segment
from velox_core.policy import WindowVotePolicy
from velox_core.policy.base import warn_unbounded

from .pages import PageSummaries, summary_weight
from .sparse import select_tokens, sparse_settings
from .split import body_capacity

__all__ = ["RocketKVPolicy"]


class RocketKVPolicy(WindowVotePolicy):
    """RocketKV's retention policy and sparse decode.

    Args:
        budget: per KV head: sinks, window, kept body tokens and their page summaries (one
            token each), or None (nothing evicted).
        every: during decode, cut again once the cache exceeds its kept tokens by ``every``
            (None: only after prefill chunks, as the paper).
        observe, kernel, pooling: SnapKV++'s observation window and vote pooling.
        ratio: the second stage's compression (None: no second stage; every kept token is
            attended and no summaries are kept).
        topk, page, channels: the second stage's tokens attended, tokens per page and key
            channels scored (None: from ``ratio``, :class:`~velox_rocketkv.HybridSparse`).

    Attributes:
        sparse_steps: decode steps that attended a top-k selection (the others attended
            every kept token: no more of them than ``topk``).
    """

    name = "rocketkv"
    settings = ("ratio", "topk", "page", "channels")

    def __init__(
        self,
        budget: int | None = None,
        every: int | None = None,
        observe: int = 32,
        kernel: int = 63,
        pooling: str = "max",
        ratio: float | None = 6.0,
        topk: int | None = None,
        page: int | None = None,
        channels: int | float | None = None,
    ):
        super().__init__(budget, every, observe, kernel, pooling)
        self.sparse = sparse_settings(ratio, topk, page, channels)
        self.ratio, self.topk, self.page, self.channels = ratio, topk, page, channels
        self.pages = None if self.sparse is None else PageSummaries(self.sparse.page_size)
        self.sparse_steps = 0
        self._weight: tuple | None = None  # ((widths, dtype), summary_weight)

    # -- the budget ------------------------------------------------------------------------
    def body_budget(self, view) -> int:
        """Body tokens a cut keeps: those that fit beside their page summaries in the budget
        less the sinks and window, a summary counted at its bytes over a kept token's
        (:func:`~velox_rocketkv.pages.summary_weight`; 1 until the cache's widths are known)."""
        room = self.budget - view.sinks - view.window
        if self.sparse is None:
            return room
        return body_capacity(room, self.sparse.page_size, self.summary_weight(view))

    def summary_weight(self, view) -> float:
        """A page summary's bytes over one kept token's in ``cache`` (measured once per
        widths and dtype)."""
        dk, dv = view.key_dim, view.value_dim  # None before any token
        if dk is None:
            return 1.0
        key = (dk, dv, view.dtype)
        if self._weight is None or self._weight[0] != key:
            kc, vc = view.codecs
            self._weight = (key, summary_weight(kc, vc, dk, dv, view.dtype))
        return self._weight[1]

    def attach(self, view) -> None:
        super().attach(view)
        if self.budget is None:
            return
        body = self.body_budget(view)
        need = max(0, self.vote.observe - view.window)
        if body <= need:
            page = None if self.sparse is None else self.sparse.page_size
            raise ValueError(
                f"budget={self.budget} leaves {body} body tokens beside their page summaries "
                f"(page={page}: one summary per {page} tokens counts as a token) after "
                f"sinks={view.sinks} and window={view.window}; they must exceed the "
                f"{need} observation-window tokens kept there (observe={self.vote.observe}) "
                "so that at least one voted token fits: raise budget"
            )

    def before_update(self, view, incoming: int) -> None:
        """Cut to the sinks, window and :meth:`body_budget` when due (velox-core's cadence,
        :meth:`RetentionPolicy.before_update <velox_core.RetentionPolicy.before_update>`,
        with the body's share of the budget in place of the budget)."""
        after_chunk, self._chunk_pending = self._chunk_pending, incoming > 1
        if self.budget is None:
            return
        kept = view.sinks + view.window + self.body_budget(view)
        over = view.size() - kept
        if self.every is None and over >= kept and not after_chunk:
            warn_unbounded(self, view.size())
        if over <= 0 or not (after_chunk or (self.every is not None and over >= self.every)):
            return
        view.evict(self.select(view, max(kept - view.protected_count(), 0)))

    def select(self, view, k: int):
        """SnapKV++'s kept body tokens; the page summaries are made again at the next step."""
        if self.pages is not None:
            self.pages.invalidate()
        return super().select(view, k)

    # -- stage 2 ------------------------------------------------------------------------------
    def decode_segments(self, view, queries: mx.array, scale: float) -> list | None:
        """The sinks, the ``topk`` body tokens per KV head the approximate scores pick, and the
        window; None (every token) where the body holds no more than ``topk`` tokens."""
        if self.sparse is None or view.ragged or view.kv_heads is None:
            return None
        n_body = view.body_sizes()[0]
        k = self.sparse.top_k(self.body_budget(view) if self.budget is not None else n_body)
        if n_body <= k:
            return None
        segs = view.segments()  # sinks (if any) | body | window (if any)
        i = 1 if view.sink_count() else 0
        body = segs[i]
        kt = self.pages.refresh(body, view.dtype or queries.dtype)
        b, hq, _, d = queries.shape
        h = view.kv_heads
        q = queries.reshape(b, h, hq // h, d)
        channels = self.sparse.channel_count(d)
        idx = select_tokens(q, kt, n_body, self.pages.page, channels, k, scale)
        keys, values = body.keys.take(idx), body.values.take(idx)
        picked = Segment(body.key_codec, keys, body.value_codec, values)
        self.sparse_steps += 1
        return [*segs[:i], picked, *segs[i + 1 :]]

    # -- batch rows, trims and state ---------------------------------------------------------
    def filter_batch(self, idx: mx.array) -> None:
        super().filter_batch(idx)
        if self.pages is not None:
            self.pages.invalidate()

    def extend_batch(self, other: WindowVotePolicy) -> None:
        super().extend_batch(other)
        if self.pages is not None:
            self.pages.invalidate()

    def state(self) -> dict[str, mx.array]:
        out = super().state()
        if self.pages is not None:
            out.update({f"pages.{k}": a for k, a in self.pages.state().items()})
        return out

    def meta(self) -> Any:
        pages = {} if self.pages is None else {"pages": self.pages.meta()}
        return {**super().meta(), **pages}

    def set_state(self, state: dict[str, mx.array], meta: Any) -> None:
        state = dict(state)
        kt = state.pop("pages.kt", None)
        super().set_state(state, meta)
        if self.pages is not None:
            self.pages.set_state(kt, (meta or {}).get("pages"))
        elif kt is not None:
            raise ValueError("rocketkv: page summaries in the state of a policy without stage 2")

    @property
    def nbytes(self) -> int:
        """The buffered queries and the page summaries (their spare rows included)."""
        window = sum(a.nbytes for a in super().state().values())
        return window + (0 if self.pages is None else self.pages.nbytes)
