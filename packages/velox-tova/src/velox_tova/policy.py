"""``TOVAPolicy``: evict the tokens the last query attends to least (arXiv 2401.06104).

TOVA (Token Omission Via Attention; Oren et al., *Transformers are Multi-State RNNs*)
treats a decoder with a bounded cache as a multi-state RNN: once the cache holds more than
``budget`` tokens, it keeps the ``budget`` tokens to which the *current* (last)
query gives the most attention, **averaged over the layer's heads**, and drops the rest;
during decode that is one token per step. All heads of a layer keep the same tokens.

How it runs in velox: :meth:`TOVAPolicy.observe` keeps the last query of each attention call
(post-RoPE, as ``VeloxCache.attend`` passes them, so only inside ``velox_core.routed(model)``
or ``velox_core.generate``; velox-core's :class:`~velox_core.policy.QueryWindow` of one
query holds it). velox-core calls
:meth:`~velox_core.RetentionPolicy.before_update` before the next tokens are stored: after a
prefill chunk, and during decode once the cache holds ``budget + every`` tokens (``every=1``:
the paper's step-by-step eviction). The cut recomputes the kept query's softmax weights over
every stored token (sinks, body, window: the same weights its attention computed, since
nothing was stored since), averages them over all query heads (GQA: over the query heads of
every KV head) and keeps the top ``budget - protected`` body tokens, one selection shared by
the layer's KV heads. Deferring the paper's post-attention eviction to the next update keeps
the same tokens and the same cache sizes: attention always runs over ``budget`` tokens plus
the new one, as in the authors' cache.

Deviations from the paper (also in docs/tova.md):

* **Chunked prefill.** The authors reduce the prompt's cache once, with the last prompt
  query; here each prefill chunk is followed by a cut scored by that chunk's last query, so
  peak memory stays at ``budget`` plus one chunk. A prompt in one chunk gets exactly the
  paper's rule. mlx-lm's ``generate`` feeds the last prompt token as a step of its own: the
  prompt's cut is then scored by the second-to-last prompt token's query.
* **``every`` > 1** evicts ``every`` tokens at once, scored by the latest query alone (the
  paper evicts one per step, each scored by its own query). ``every=None`` compresses the
  prompt only (kvpress's ``TOVAPress`` as a prefill press).
* **Unseen tokens.** Tokens stored after the kept query (never seen by any query; only when
  ``update_and_fetch`` runs without attention) are kept at the cut.
* **No observed query**: without routing a cut raises (no query can ever score); routed but
  before any query reached the cache, a cut keeps the most recent tokens.
* Weights come from the stored keys (their codes when ``bits`` is set); learned per-head
  sink logits (gpt-oss) are not part of their softmax. ``sinks`` and ``window`` (always
  kept) are velox settings; ``window=1`` keeps the newest token as kvpress does.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx

from velox_core import RetentionPolicy
from velox_core.policy import QueryWindow, top_k_sorted
from velox_core.policy.base import require_routed
from velox_core.policy.window import WindowRows

__all__ = ["TOVAPolicy"]


class TOVAPolicy(WindowRows, RetentionPolicy):
    """TOVA's retention policy: one head-averaged selection per layer.

    Args:
        budget: tokens kept per KV head (sinks + body + window), or None (keep all).
        every: during decode, cut once the cache holds ``budget + every`` tokens (1: the
            paper, one token per step; None: only after prefill chunks).
    """

    name = "tova"

    def __init__(self, budget: int | None = None, every: int | None = 1):
        super().__init__(budget, every)
        self.window = QueryWindow(1)  # the last query seen, (B, Hq, 1, D)

    # the kept query and its absolute position (tests read them)
    @property
    def _query(self) -> mx.array | None:
        return self.window.queries

    @property
    def _q_pos(self) -> int:
        return self.window.end - 1

    # -- the last query ---------------------------------------------------------------------
    def observe(self, view, queries: mx.array, scale: float) -> None:
        """Keep the last query of this call (it sits at the newest stored position).

        Without ``every`` single decode queries never score a cut and are not kept, and the
        query is dropped after the cut it scores, so decode holds no policy state.
        """
        if self.wants_weights(queries.shape[2]):
            self.window.add(view, queries, scale)

    def wants_weights(self, n: int) -> bool:
        """Whether a call of ``n`` queries scores a cut (with a budget; single decode queries
        only with ``every``): its last query's attention weights are then kept from the
        call, not computed again at the cut (while nothing is stored in between)."""
        return self.budget is not None and not (self.every is None and n == 1)

    def observe_weights(self, view, queries: mx.array, scale: float, weights: mx.array) -> None:
        """Keep the last query of this call and its weights (:meth:`QueryWindow.add`)."""
        if self.wants_weights(queries.shape[2]):
            self.window.add(view, queries, scale, weights)

    def after_update(self, view, start: int) -> None:
        """Tokens were stored: the kept weights no longer cover the cache."""
        self.window.stored()

    # -- choosing ---------------------------------------------------------------------------
    def score(self, view) -> list[mx.array | None]:
        """Per KV head ``(B, T)`` float32, the same for every head: the last query's attention
        weight on each body token, averaged over all query heads (unseen tokens ``+inf``)."""
        body_pos = view.body_positions(joined=True)
        if body_pos is None:
            return view.body_positions()
        return [self._layer_scores(view, body_pos)] * body_pos.shape[1]

    def select(self, view, k: int):
        """One top-``k`` selection, shared by the layer's KV heads: ``(B, H, k)``."""
        body_pos = view.body_positions(joined=True)
        if body_pos is None:
            keep = mx.zeros((view.batch, view.kv_heads, 0), dtype=mx.int32)
        else:
            idx = top_k_sorted(self._layer_scores(view, body_pos), k)
            keep = mx.broadcast_to(idx[:, None], (idx.shape[0], body_pos.shape[1], idx.shape[-1]))
        if self.every is None:
            self.window.clear()  # no decode cuts: this query will not score again
        return keep

    def _layer_scores(self, view, body_pos: mx.array) -> mx.array:
        # the kept query's softmax weights on the body (B, H, T), or None (none, other rows,
        # or its token was trimmed away)
        w = self.window.votes(view, body_pos)
        # every head holds the same tokens (one selection per layer): the first head's
        if w is None:  # no query has reached the cache (refused unless routed): the newest
            require_routed(view, "tova", "the last query's attention chooses the tokens to keep")
            return body_pos[:, 0].astype(mx.float32)
        s = mx.mean(w, axis=1)  # mean over KV heads of the group means = over query heads
        if self._q_pos >= view.offset - 1:  # the query is the newest token's: it saw them all
            return s
        return mx.where(body_pos[:, 0] > self._q_pos, mx.inf, s)

    # batch rows: WindowRows (a batch of other positions scores from the next query)

    # -- state: {"query": (B, Hq, 1, D)}, meta "q_pos" (its position, -1: none) and "scale" --
    def state(self) -> dict[str, mx.array]:
        return self.window.state("query")

    def meta(self) -> Any:
        return {**super().meta(), "q_pos": self._q_pos, "scale": self.window.scale}

    def set_state(self, state: dict[str, mx.array], meta: Any) -> None:
        state = dict(state)
        query = state.pop("query", None)
        if query is not None and (query.ndim != 4 or query.shape[2] != 1):
            raise ValueError(f"tova: the kept query must be (B, Hq, 1, D), got {query.shape}")
        super().set_state(state, meta)
        meta = meta or {}
        q_end = int(meta.get("q_pos", -1)) + 1
        self.window.set_state(query, {"q_end": q_end, "scale": meta.get("scale")})
