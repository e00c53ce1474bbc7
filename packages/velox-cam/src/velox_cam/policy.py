"""``CamPolicy``: keep the first and the newest tokens, and merge each evicted token's value
into the tokens kept after it (CaM, ICML 2024).

CaM (Zhang et al., *CaM: Cache Merging for Memory-efficient LLMs Inference*,
https://proceedings.mlr.press/v235/zhang24n.html; code ``zyxxmu/cam``) observes that an
evicted token leaves the attention output short of its share ``A_e v_e``, whichever token is
chosen, and merges the to-be-evicted value into the tokens that remain instead of dropping
it. Its cache (``generate_task/streaming_llm/kv_cache_cam.py``, ``StartRecentKVCache_cam``:
the authors' cache that drops tokens) keeps the first tokens and the newest ones, as
StreamingLLM, and accumulates every query's attention weights on each cached token, as H2O.
When the oldest token outside the first ones leaves the recent window it is merged with
probability ``clip(A_e / mean(A_next), 0, 1)``, ``A_next`` the scores of the ``merge`` tokens
after it, by adding ``value / merge`` to each of their values (:mod:`velox_cam.merge`); its
key, value and score then leave the cache.

How it runs in velox: the scores are velox-core's :class:`~velox_core.policy.AccumulatedPolicy`
(one float32 per stored token and KV head; :meth:`~AccumulatedPolicy.observe`, called by
``VeloxCache.attend`` with the post-RoPE queries, adds their softmax weights, so attention
must be routed: ``velox_core.routed(model)`` or ``velox_core.generate``). The cut
(velox-core's ``before_update``: after each prefill chunk, and during decode once the cache
holds ``budget + every`` tokens) keeps the sinks and the newest ``budget - sinks`` tokens;
:meth:`CamPolicy.select` merges the evicted values into the kept ones, oldest first (it
decodes the values of the evicted tokens and of the ``merge`` after them, no others); the
evicted tokens then leave memory, and :meth:`CamPolicy.before_update` writes the ``merge``
merged values over the oldest kept ones (``VeloxCache.set_body_values``): a cut writes those
rows alone, not the body.

Deviations from the authors' cache (also in docs/cam.md):

* **Chunked prefill and ``every`` > 1.** The authors feed the prompt a token at a time and
  evict one token per step, each merge drawn with the scores of its step. Here a cut of
  ``n`` tokens applies the same rule ``n`` times, oldest first (an evicted value merges, with
  what it received, into the ``merge`` tokens after it, some of which leave in the same
  cut), with the scores at the cut; the queries of a chunk see the whole chunk.
* **GQA.** The authors' caches are per attention head (MHA); a KV head's score is the mean of
  its query heads' weights (as velox's H2O), and one mask is drawn per KV head.
* **Seeded draws.** One uniform number per evicted token and KV head, from a key of ``seed``
  and the layer index split at every cut and saved with the state, shared by the batch rows
  (a row merges when its number is below its probability): a run, a run resumed after
  loading and a row in any batch draw alike. The authors draw from torch's generator.
* **Positions.** The authors' streaming cache re-numbers positions inside the cache; velox
  keeps absolute positions (keys are stored after RoPE). ``offset`` counts every token.
* Tokens no query has attended score zero: evicted, they are not merged. Without routing a
  cut that meets them raises. Scores accumulate in float32 from the stored keys; values
  merge in float32 and are stored in the cache's dtype (re-coded when ``bits`` is set).
"""

from __future__ import annotations

import mlx.core as mx

from velox_core.policy.accumulated import AttentionVotes, SeededDraws, layer_key
from velox_core.validation import check_int

from .merge import merge_probabilities, merged_values

__all__ = ["SCORE_ELEMENTS", "CamPolicy", "layer_key"]

# attention weights formed at once when a chunk of queries is scored
SCORE_ELEMENTS = 1 << 20


class CamPolicy(AttentionVotes, SeededDraws):
    """CaM's retention policy: the sinks and the newest tokens stay, each evicted value is
    merged into the ``merge`` tokens after it with a probability from accumulated attention.

    Args:
        budget: tokens kept per KV head (sinks, then the newest tokens), or None.
        every: during decode, cut once the cache holds ``budget + every`` tokens (1: the
            authors, one token per step; None: only after prefill chunks).
        merge: the kept tokens an evicted value is spread over (the authors' ``merge_num``).
        seed: seed of the merge draws.
    """

    name = "cam"
    settings = ("merge", "seed")
    kept_name = "token after the sinks"

    def __init__(
        self, budget: int | None = None, every: int | None = 1, merge: int = 16, seed: int = 0
    ):
        super().__init__(budget, every, recent=0)
        self.merge = check_int("merge", merge, minimum=1)
        self.start_draws(seed)  # one draw of merge masks a cut
        self._merged: mx.array | None = None  # select's merged values, written after the cut

    def attach(self, view) -> None:
        super().attach(view)
        kept = None if self.budget is None else self.budget - view.sinks - view.window
        if kept is not None and self.merge > kept:
            raise ValueError(
                f"merge={self.merge} must be at most budget - sinks - window = {kept} (an "
                "evicted value merges into the oldest kept tokens of the coded body)"
            )

    @property
    def score_elements(self) -> int:
        return SCORE_ELEMENTS

    def uniform(self, shape: tuple[int, ...]) -> mx.array:
        """The next draw of uniform numbers in ``[0, 1)``: the key is split, one half kept."""
        return mx.random.uniform(shape=shape, key=self.next_key())

    # -- choosing ----------------------------------------------------------------------------
    def score(self, view) -> list[mx.array | None]:
        """Per KV head ``(B, T)``: the body tokens' positions (the newest are kept)."""
        return [None if p is None else p.astype(mx.float32) for p in view.body_positions()]

    def before_update(self, view, incoming: int) -> None:
        """velox-core's cut (:meth:`select`, then the evicted tokens leave), then the merged
        values written over the ``merge`` oldest kept tokens. Written after the evicted
        tokens left, the write reaches buffers nothing else reads, and so stays in place:
        ``merge`` rows a cut, not a copy of the body."""
        self._merged = None  # only the values of this cut's select
        super().before_update(view, incoming)
        if self._merged is not None:
            merged, self._merged = self._merged, None
            view.set_body_values(0, merged)

    def select(self, view, k: int):
        """Keep the newest ``k`` body tokens; merge the values of the others into the
        ``merge`` oldest kept ones (:func:`~velox_cam.merge.merged_values`; written by
        :meth:`before_update` once the others left), then drop their scores. Returns the
        kept body indices, shared by every head and row: ``(k,)``."""
        sizes = view.body_sizes()  # every head's (one record: no per-head budgets)
        if not sizes or not sizes[0]:
            return mx.zeros((0,), dtype=mx.int32)
        t = sizes[0]
        n = t - k
        if n <= 0:
            return mx.arange(t, dtype=mx.int32)
        self._sync(view)
        self._check_routed(
            view,
            "the attention every query gives each token decides whether an evicted value is merged",
        )
        if k < self.merge:
            raise ValueError(
                f"{self.name}: a cut keeping {k} body tokens cannot merge into {self.merge}"
            )
        n_sink, m = view.sink_count(), self.merge
        body = self._body_part(n_sink, t)
        prob = merge_probabilities(body[:, :, : n + m], n, m)  # (B, H, n)
        mask = self.uniform((1, *prob.shape[1:])) < prob
        values = view.body_values(stop=n + m, joined=True)
        self._merged = merged_values(values, mask, m)
        self._scores = self._body_replaced(n_sink, t, body[:, :, n:])
        return mx.arange(n, t, dtype=mx.int32)

    # state: "scores" (B, H, S) float32, "key" uint32 (2,); meta seen, draws (SeededDraws)
