"""``MorphKVPolicy``: keep the recent window and the older tokens it attends to most
(arXiv 2503.00979).

MorphKV (Ghadia et al., *Dialogue Without Limits: Constant-Sized KV Caches for Extended
Responses in LLMs*, ICML 2025) holds a cache of constant size ``C + R`` through a whole
generation: the ``R`` most recent tokens (local coherence, the paper's heuristic H1) and the
``C`` older tokens those recent tokens attended to most (distant relevance, H2). At step
``i`` the window ``W_i = {x_{i-1}, ..., x_{i-R}}`` gives each older token ``k`` a fused score
``F_i[k] = f(AW_{i-1}[k], ..., AW_{i-R}[k])`` (equation 4), with ``AW_r`` the softmax
attention weights of token ``r``'s query (equation 1, the query heads of a KV head summed
under GQA, Algorithm 1) and ``f`` a sum (equation 5: tokens attended consistently) or a max
(equation 6: tokens attended strongly by at least one recent token). The cache keeps
``TopC(F_i) ∪ W_i`` (equation 7), re-selected at every decode step, so that, unlike SnapKV,
generated tokens are evicted too and memory never grows with the response.

How it runs in velox: velox-core calls :meth:`~velox_core.RetentionPolicy.before_update`
before the next tokens are stored: after a prefill chunk, and during decode once the cache
holds ``budget + every`` tokens (``every=1``: the paper's cut at every step). The cut runs
before the new token is stored, with the window of the ``R`` tokens before it, so attention
runs over ``budget`` tokens plus the new one, as in the authors' cache. The cut keeps, per KV
head, the newest ``observe`` tokens (the window itself, ``+inf``) and the top ``budget -
observe - sinks`` older ones by the window's fused weights. The window is seen through
:meth:`MorphKVPolicy.observe`, which gets each attention call's post-RoPE queries (they reach
the cache only inside ``velox_core.routed(model)`` or ``velox_core.generate``), kept one of
two ways:

* ``keep_weights=True`` (the default), the authors' storage and weights
  (:class:`~velox_morphkv.kept.KeptWeights`): one row per KV head and each of the newest
  ``observe`` queries, over the stored tokens, the softmax numerators of the sum of the KV
  head's query heads' logits (``exp(Σ_g l_g - c)``), bfloat16; a decode step's row comes
  from its attention's weights (``observe_weights``), a prefill chunk's from the summed
  queries; a stored token gets a zero column (the older queries cannot see it), and a cut
  keeps the kept tokens' columns. The cut renormalizes each row over the older body tokens
  alone (those before the newest ``observe``, the authors' candidates: each row's softmax
  over them, with no exponential) and fuses them (sum or max). No query is kept; ``H ×
  observe × (budget + every + 1)`` bfloat16 a sequence and layer.
* ``keep_weights=False``: velox-core's :class:`~velox_core.policy.QueryWindow` keeps the
  queries, and every cut scores them against the stored keys again: each query head's softmax
  over every stored token it sees (the paper's ``AW_r``, equation 1, sinks and window
  included), averaged over the query heads of each KV head and fused
  (:func:`~velox_core.policy.window_votes`). ``observe × Hq × D`` in the queries' dtype.

The two normalisations can keep different tokens (a query that attends mostly to the window
weighs less in the paper's).

Deviations from the paper and the authors' code (also in docs/morphkv.md):

* **The prompt.** The authors hold the whole prompt and compress it at the first decode step,
  voted by the prompt's last ``R`` queries: ``prefill="prompt"``. With the default
  ``prefill="chunks"`` each prefill chunk is followed by a cut voted by that chunk's last
  ``observe`` queries, so peak memory stays at ``budget`` plus one chunk.
* **GQA.** The authors keep each query head's logits and prune each query head's rows by that
  head's own top-k, while the keys are pruned by the KV head's (with more than one query head
  a KV head, a row's columns then name other tokens than the kept keys); their KV-head
  selection reads only the sum over the group, which is what is kept here, pruned by the KV
  head's selection.
* **Precision.** The rows are bfloat16 softmax numerators (the authors' rows: logits in the
  model's dtype), the renormalization and the fusion run in float32 (theirs in the model's
  dtype). A token more than about ``e^-80`` below its row's best (its own token or the
  window's, summed over the query heads) weighs zero in that row.
* **``every`` > 1** (the paper's coarse-grained eviction, appendix A.5) cuts ``every``
  tokens at once, voted by the latest window.
* **No observed queries**: without routing a cut raises (no query can ever vote); routed but
  with no window over the stored tokens (before any query reached the cache; with the kept
  weights, also after a trim or a merge of batch rows at other positions) a cut keeps the
  most recent tokens; tokens stored after the newest window query
  (never seen by it) are kept.
* Weights come from the stored keys (their codes when ``bits`` is set, as attention reads
  them; kept weights keep the scores of the keys a query attended, also where a coded
  cache's ``window`` codes them later); learned per-head sink logits (gpt-oss) are not part
  of their softmax.

State: ``{"weights": (B, H, n <= observe, S)}`` bfloat16, meta ``q_end`` (the position after
the newest query) and ``covered`` (the offset and stored tokens the columns cover); scored
again, ``{"queries": (B, Hq, n, D)}`` and meta ``q_end`` and ``scale``.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx

from velox_core import RetentionPolicy
from velox_core.policy import QueryWindow, check_fusion, top_k_sorted
from velox_core.policy.base import require_routed
from velox_core.policy.window import WindowState
from velox_core.validation import check_bool, check_int

from .kept import KeptWeights

__all__ = ["MorphKVPolicy"]


class MorphKVPolicy(WindowState, RetentionPolicy):
    """MorphKV's retention policy: per KV head, the recent window and the older tokens it
    attends to most.

    Args:
        budget: tokens kept per KV head (the paper's total capacity ``C + R``: sinks, the
            recent window and the older tokens it votes for), or None (keep every token).
        every: during decode, cut once the cache holds ``budget + every`` tokens (1: the
            paper, a re-selection at every step).
        observe: the recent window ``R``: how many of the newest queries vote, and how many
            of the newest tokens are always kept.
        fusion: how the window's weights on a token combine: ``"sum"`` or ``"max"``.
        keep_weights: keep the window's weights from one cut to the next as the authors do
            (True: one bfloat16 row per KV head and query, :class:`~velox_morphkv.kept.
            KeptWeights`, and the authors' softmax over the older tokens of the KV head's
            summed logits), or keep the window's queries and score them again at every cut
            (False: each query head's softmax over every token it sees, the paper's ``AW_r``).
    """

    name = "morphkv"

    def __init__(
        self,
        budget: int | None = None,
        every: int = 1,
        observe: int = 32,
        fusion: str = "sum",
        keep_weights: bool = True,
    ):
        if every is None:
            raise ValueError(
                "every=None: MorphKV re-selects the kept tokens during decode (that bounds a "
                "long response); every must be a whole number of decode steps >= 1 (1: the "
                "paper). For a prompt-only cut use snapkv"
            )
        super().__init__(budget, every)
        self.fusion = check_fusion(fusion)
        size = check_int("observe", observe, minimum=1)
        kept = check_bool("keep_weights", keep_weights)
        self.window = KeptWeights(size) if kept else QueryWindow(size)

    @property
    def keep_weights(self) -> bool:
        return isinstance(self.window, KeptWeights)

    def config(self) -> dict[str, Any]:
        return {
            **super().config(),
            "observe": self.window.size,
            "fusion": self.fusion,
            "keep_weights": self.keep_weights,
        }

    def attach(self, view) -> None:
        super().attach(view)
        always = view.sinks + max(view.window, self.window.size)
        if self.budget is not None and self.budget <= always:
            raise ValueError(
                f"budget={self.budget} must exceed sinks + max(window, observe) = {always} "
                "(the recent window is always kept, and at least one older token must fit)"
            )

    def observe(self, view, queries: mx.array, scale: float) -> None:
        """The newest ``observe`` queries of this call join the window: their rows
        (:meth:`KeptWeights.add`), or the queries themselves (:meth:`QueryWindow.add`)."""
        if self.budget is None:
            return
        if self.keep_weights:
            self.window.add(view, queries, scale)
        else:
            # a full cache is cut at least every `every` steps, reading the buffer: no chain
            self.window.add(view, queries, scale, detach=view.size() < self.budget)

    def wants_weights(self, n: int) -> bool:
        """Whether the window keeps its weights (``keep_weights``, with a budget): a decode
        step's attention then hands over the weights it computed."""
        return self.budget is not None and self.keep_weights

    def observe_weights(self, view, queries: mx.array, scale: float, weights: mx.array) -> None:
        """The newest queries of this call join the window with their attention's weights
        (:meth:`KeptWeights.add_weights`)."""
        if self.wants_weights(queries.shape[2]):
            self.window.add_weights(view, weights)

    def after_update(self, view, start: int) -> None:
        """Tokens were stored: kept weights gain their columns (:meth:`KeptWeights.appended`)."""
        if self.keep_weights:
            self.window.appended(view, start)

    # -- choosing ---------------------------------------------------------------------------
    def score(self, view) -> list[mx.array | None]:
        """Per KV head ``(B, T)`` float32: the window's fused weight on each older body token;
        ``+inf`` for the newest ``observe`` tokens and for tokens no window query has seen."""
        s = self._scores(view)
        return view.body_positions() if s is None else [s[:, h] for h in range(s.shape[1])]

    def _scores(self, view) -> mx.array | None:
        """:meth:`score` of every KV head at once, ``(B, H, T)`` (None: no body token)."""
        body_pos = view.body_positions(joined=True)  # (B, H, T)
        if body_pos is None:
            return None
        votes = self.window.votes(view, body_pos, self.fusion)
        if votes is None:  # no query has reached the cache (refused unless routed): the newest
            require_routed(view, "morphkv", "the recent window chooses the older tokens to keep")
            s = body_pos.astype(mx.float32)
        elif self.window.end < view.offset:  # (at a decode step's cut every token was seen)
            s = mx.where(body_pos >= self.window.end, mx.inf, votes)
        else:
            s = votes
        return mx.where(body_pos >= view.offset - self.window.size, mx.inf, s)

    def select(self, view, k: int):
        """The top ``k`` body tokens per KV head, ``(B, H, k)``; kept weights keep their
        columns (:meth:`KeptWeights.kept`)."""
        s = self._scores(view)
        if s is None:
            keep = mx.zeros((view.batch, view.kv_heads, 0), dtype=mx.int32)
        else:
            keep = top_k_sorted(s, k)
        if self.keep_weights:
            self.window.kept(view, keep, self.every)
        return keep

    # -- state: the window's queries ({"queries": (B, Hq, n, D)}, meta "q_end" and "scale",
    # WindowState's) or its rows ({"weights": (B, H, n, S)} bfloat16, meta "q_end" and
    # "covered")
    def state(self) -> dict[str, mx.array]:
        return self.window.state("weights") if self.keep_weights else super().state()

    def set_state(self, state: dict[str, mx.array], meta: Any) -> None:
        if not self.keep_weights:
            super().set_state(state, meta)
            return
        state = dict(state)
        weights = state.pop("weights", None)
        RetentionPolicy.set_state(self, state, meta)
        self.window.set_state(weights, meta)

    @property
    def nbytes(self) -> int:
        """The window's bytes: its bfloat16 rows (with the columns held for the next
        tokens), or its queries."""
        return self.window.nbytes if self.keep_weights else super().nbytes
