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

How it runs in velox: :meth:`MorphKVPolicy.observe` buffers the newest ``observe`` (``R``)
post-RoPE queries of its layer (velox-core's :class:`~velox_core.policy.QueryWindow`; they
reach the cache only inside ``velox_core.routed(model)`` or ``velox_core.generate``). velox-core
calls :meth:`~velox_core.RetentionPolicy.before_update` before the next tokens are stored:
after a prefill chunk, and during decode once the cache holds ``budget + every`` tokens
(``every=1``: the paper's cut at every step). The cut takes the buffered queries' softmax
weights over every stored token (sinks, body, window), averages them over the query heads of
each KV head, fuses them over the queries by ``fusion``
(:func:`~velox_core.policy.window_votes`) and keeps, per KV head, the newest ``observe``
tokens (the window itself, ``+inf``) and the top ``budget - observe - sinks`` older ones. The
cut runs before the new token is stored, with the window of the ``R`` tokens before it, so
attention runs over ``budget`` tokens plus the new one, as in the authors' cache.

With ``keep_weights=True`` the weights are kept from one cut to the next, as the authors keep
each window query's attention over the held tokens: a decode step's query brings the weights
its attention computed (``observe_weights``), written over the oldest query's row; a stored
token takes a zero column (the older queries cannot see it), held ready by the cut before;
and a cut keeps the kept tokens' columns, in one gather. Each cut then renormalizes every
query's weights over the tokens still stored, which is its softmax over them, instead of
scoring the ``R`` queries against every stored key again (``R × Hq × budget`` dot products
and as many exponentials a step). They cost ``Hq × observe × (budget + every + 1)`` float32
a sequence and layer (counted in ``nbytes``): at 128 channels and 4 query heads a KV head,
about as much as the kept fp16 keys and values, three times their 4-bit codes.
With ``keep_weights=False`` (the default) every cut scores the queries again. Kept or not,
the weights are those of the same tokens, and the same tokens are kept. Over coded keys
(``bits``) a step's new weights come from the keys as decoded, not from its attention's
scores of the codes. A cut after a prefill chunk, after loading, after a change of batch
rows or a trim, or with keys that change as they leave a coded cache's window (``window``
with ``bits``) scores the queries again.

Deviations from the paper (also in docs/morphkv.md):

* **The prompt.** The authors hold the whole prompt and compress it at the first decode step,
  voted by the prompt's last ``R`` queries: ``prefill="prompt"``. With the default
  ``prefill="chunks"`` each prefill chunk is followed by a cut voted by that chunk's last
  ``observe`` queries, so peak memory stays at ``budget`` plus one chunk.
* **Normalisation.** Each window query's softmax runs over everything it sees among the
  tokens stored at the cut (the paper's ``AW_r``); the authors' code renormalises each
  query's weights over the older tokens alone and sums the logits of a KV head's query
  heads before that softmax (the paper sums their weights).
* **``every`` > 1** (the paper's coarse-grained eviction, appendix A.5) cuts ``every``
  tokens at once, voted by the latest window.
* **No observed queries**: without routing a cut raises (no query can ever vote); routed but
  before any query reached the cache, a cut keeps the most recent tokens; tokens stored after
  the newest buffered query (never seen by it) are kept.
* Weights come from the stored keys (their codes when ``bits`` is set); learned per-head sink
  logits (gpt-oss) are not part of their softmax.

State: ``{"queries": (B, Hq, n <= observe, D)}``; meta adds ``q_end`` (the position after the
newest query) and ``scale`` to the base policy's. The kept weights are not saved: the first
cut after loading scores the queries again.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx

from velox_core import RetentionPolicy
from velox_core.codec.identity import Identity
from velox_core.policy import QueryWindow, check_fusion
from velox_core.policy.window import WindowState
from velox_core.validation import check_bool, check_int

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
        keep_weights: keep the window's weights from one cut to the next (float32, ``Hq ×
            observe`` per stored token and sequence) instead of scoring the window's queries
            again at every cut (False): the same tokens kept, for fewer operations a step.
    """

    name = "morphkv"

    def __init__(
        self,
        budget: int | None = None,
        every: int = 1,
        observe: int = 32,
        fusion: str = "sum",
        keep_weights: bool = False,
    ):
        if every is None:
            raise ValueError(
                "every=None: MorphKV re-selects the kept tokens during decode (that bounds a "
                "long response); every must be a whole number of decode steps >= 1 (1: the "
                "paper). For a prompt-only cut use snapkv"
            )
        super().__init__(budget, every)
        self.fusion = check_fusion(fusion)
        rolling = check_bool("keep_weights", keep_weights)
        self.window = QueryWindow(check_int("observe", observe, minimum=1), rolling)
        self._plain_keys = False  # the keys stored as given (attach)

    def config(self) -> dict[str, Any]:
        return {
            **super().config(),
            "observe": self.window.size,
            "fusion": self.fusion,
            "keep_weights": self.window.rolling,
        }

    def attach(self, view) -> None:
        super().attach(view)
        self._plain_keys = isinstance(view.codecs[0], Identity)
        always = view.sinks + max(view.window, self.window.size)
        if self.budget is not None and self.budget <= always:
            raise ValueError(
                f"budget={self.budget} must exceed sinks + max(window, observe) = {always} "
                "(the recent window is always kept, and at least one older token must fit)"
            )

    def observe(self, view, queries: mx.array, scale: float) -> None:
        """Buffer the newest ``observe`` queries of this call (:meth:`QueryWindow.add`)."""
        if self.budget is not None:
            # a full cache is cut at least every `every` steps, reading the buffer: no chain
            full = view.size() >= self.budget
            self.window.add(view, queries, scale, detach=not full)

    def wants_weights(self, n: int) -> bool:
        """Whether the window keeps its weights (``keep_weights``, with a budget) and the
        keys are stored as given: a decode step's attention then hands over the weights it
        computed. Over coded keys the window computes a step's weights from the keys as
        decoded (as a cut that scores the queries again reads them), not from the
        attention's scores of the codes."""
        return self.budget is not None and self.window.rolling and self._plain_keys

    def observe_weights(self, view, queries: mx.array, scale: float, weights: mx.array) -> None:
        """Buffer the newest queries of this call with its attention weights."""
        if self.budget is not None:
            full = view.size() >= self.budget
            self.window.add(view, queries, scale, weights, detach=not full)

    def after_update(self, view, start: int) -> None:
        """Tokens were stored: the kept weights gain their columns
        (:meth:`QueryWindow.appended`)."""
        self.window.appended(view, start)

    # -- choosing ---------------------------------------------------------------------------
    def score(self, view) -> list[mx.array | None]:
        """Per KV head ``(B, T)`` float32: the window's fused weight on each older body token;
        ``+inf`` for the newest ``observe`` tokens and for tokens no buffered query has seen."""
        pos = view.body_positions()
        if any(p is None for p in pos):
            return pos
        body_pos = mx.stack(pos, axis=1)  # (B, H, T)
        votes = self.window.votes(view, body_pos, self.fusion)
        if votes is None and not view.routed:
            raise ValueError(
                "morphkv: the recent window's queries choose the older tokens to keep, and "
                "only velox attention sees them: run the model inside "
                "velox_core.routed(model) (velox_core.generate does)"
            )
        if votes is None:  # routed, but no query has reached the cache yet: the most recent
            s = body_pos.astype(mx.float32)
        else:
            s = mx.where(body_pos >= self.window.end, mx.inf, votes)
        s = mx.where(body_pos >= view.offset - self.window.size, mx.inf, s)
        return [s[:, h] for h in range(s.shape[1])]

    def select(self, view, k: int):
        """The top ``k`` body tokens per KV head, ``(B, H, k)``; the kept weights keep their
        columns (:meth:`QueryWindow.kept`)."""
        keep = super().select(view, k)
        self.window.kept(view, keep, self.every)
        return keep

    @property
    def nbytes(self) -> int:
        """The buffered queries' bytes and those of the weights kept (``keep_weights``)."""
        w = self.window.weights
        return super().nbytes + (0 if w is None or not self.window.rolling else w.nbytes)

    # batch rows and state ({"queries": (B, Hq, n, D)}, meta "q_end" and "scale"): WindowState
