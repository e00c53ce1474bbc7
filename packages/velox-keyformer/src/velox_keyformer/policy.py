"""``KeyformerPolicy``: keep the recent tokens and the key tokens of accumulated Gumbel
scores (arXiv 2403.09054).

Keyformer (Adnan et al., *Keyformer: KV Cache Reduction through Key Tokens Selection for
Efficient Generative Inference*, MLSys 2024) keeps, per attention head and within a fixed
budget, a window of the ``recent`` newest tokens and the *key tokens*: those with the
largest score accumulated over every query so far. The score is not the attention weight
but a regularised one, ``softmax((x + g) / tau)`` over the logits ``x`` with i.i.d. standard
Gumbel noise ``g`` (:func:`~velox_keyformer.score.gumbel_votes`); the noise keeps the
ranking from over-trusting tokens whose weight was inflated by earlier evictions, and the
temperature ``tau`` rises linearly from ``tau_init`` (the prompt) by ``(tau_end -
tau_init) / steps`` a decode step (:func:`~velox_keyformer.score.temperature`), flattening
the later steps' scores. The prompt's queries score every prompt token and the prompt is
reduced to the budget; each decode step adds its query's scores and evicts the
lowest-scored token outside the recent window.

How it runs in velox (velox-core's :class:`~velox_core.policy.AccumulatedPolicy`, whose
votes here are Gumbel scores): one float32 score per stored token and KV head, ``(B, H,
S)``, in the cache's storage order; new tokens start at zero
(:meth:`KeyformerPolicy.after_update`); :meth:`KeyformerPolicy.observe` (called by
``VeloxCache.attend`` with the post-RoPE queries, so only inside
``velox_core.routed(model)`` or ``velox_core.generate``) adds the queries' Gumbel scores, in
blocks of at most :data:`SCORE_ELEMENTS` scores. A call of several queries (a prompt chunk)
scores at ``tau_init`` and restarts the schedule, as the authors' prompt does; each call of
one query is a decode step. The cut (velox-core's ``before_update``: after a prefill chunk,
and during decode once the cache holds ``budget + every`` tokens) keeps per KV head the
``recent`` newest tokens and the top of the rest by accumulated score; the kept tokens keep
their scores.

Deviations from the paper and the authors' code (also in docs/keyformer.md):

* **Chunked prefill**: each prefill chunk is followed by a cut with the scores so far (peak
  memory: budget plus one chunk); a prompt in one chunk gets the paper's rule.
* **GQA**: the authors' models are MHA; a KV head's score is the mean over its query heads'
  scores (each with its own noise). Scores are per batch row (the authors sum the batch).
* **Budget and window in tokens**: ``budget`` counts tokens (the authors': a percentage of
  the prompt); ``recent`` counts the tokens stored at the cut, the incoming one comes on
  top (the authors count it in the window and never keep the token just outside it), so
  decode attention sees ``budget + 1`` tokens.
* **The schedule's length**: the authors derive the step from the run's ``max_new_tokens``;
  here ``steps`` gives it, and ``tau`` stays at ``tau_end`` after it.
* **Seeded noise**: the noise comes from a key of ``seed`` and the layer index, split at
  every draw and saved with the state, so a run (and a run resumed after loading) is
  reproducible; the authors draw from torch's global generator.
* ``every`` > 1 evicts that many tokens at once; tokens no query has attended rank above
  every scored token, newest first (a cut of them is refused unless routed); trims drop
  the trimmed tokens' scores; scores accumulate in float32 from the stored keys (their
  codes when ``bits`` is set).
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx

from velox_core.policy.accumulated import SeededDraws, layer_key
from velox_core.validation import check_float, check_int

from .score import gumbel_votes, gumbel_weights, temperature

__all__ = ["SCORE_ELEMENTS", "KeyformerPolicy", "layer_key"]

# scores formed at once when a chunk of queries is scored
SCORE_ELEMENTS = 1 << 20


class KeyformerPolicy(SeededDraws):
    """Keyformer's retention policy: accumulated Gumbel scores per KV head, a recent window
    (velox-core's :class:`~velox_core.policy.AccumulatedPolicy`, voting by Gumbel scores).

    Args:
        budget: tokens kept per KV head (sinks, key tokens, recent tokens), or None.
        every: during decode, cut once the cache holds ``budget + every`` tokens.
        recent: the newest tokens always kept, in tokens (the cache's ``window`` counts).
        tau_init, tau_end: the temperature at the prompt and after ``steps`` decode steps.
        steps: decode steps over which the temperature rises (the generation length).
        seed: seed of the Gumbel noise.
    """

    name = "keyformer"
    settings = ("recent", "tau_init", "tau_end", "steps", "seed")
    kept_name = "key token"
    key_name = "noise key"

    def __init__(
        self,
        budget: int | None = None,
        every: int | None = 1,
        recent: int = 0,
        tau_init: float = 1.0,
        tau_end: float = 2.0,
        steps: int = 512,
        seed: int = 0,
    ):
        super().__init__(budget, every, recent)
        self.tau_init = check_float("tau_init", tau_init, minimum=1e-6)
        self.tau_end = check_float("tau_end", tau_end, minimum=1e-6)
        self.steps = check_int("steps", steps, minimum=1)
        self.start_draws(seed)  # one noise draw a block of queries
        self._step = 0  # decode steps since the last prompt chunk

    @property
    def tau(self) -> float:
        """The temperature of the next scores: the schedule at the current decode step."""
        return temperature(self._step, self.tau_init, self.tau_end, self.steps)

    def noise(self, shape: tuple[int, ...]) -> mx.array:
        """The next Gumbel(0, 1) draw: the key is split, one half kept, one half drawn."""
        return mx.random.gumbel(shape=shape, key=self.next_key())

    # -- the votes -----------------------------------------------------------------------------
    @property
    def score_elements(self) -> int:
        return SCORE_ELEMENTS

    def begin(self, n: int) -> None:
        """A call of several queries (a prompt chunk) restarts the schedule; one query is a
        decode step."""
        self._step = 0 if n > 1 else self._step + 1

    def votes(
        self, queries: mx.array, q_pos: mx.array, keys: mx.array, k_pos: mx.array, scale: float
    ) -> mx.array:
        """The block's Gumbel scores over every stored token at the current temperature
        (:func:`~velox_keyformer.score.gumbel_votes`), with the next noise draw."""
        b, hq, n, _ = queries.shape
        g = self.noise((b, hq, n, keys.shape[2]))
        return gumbel_votes(queries, q_pos, keys, k_pos, scale, self.tau, g)

    def weight_votes(self, weights: mx.array, q_pos: mx.array) -> mx.array:
        """A decode step's Gumbel scores from the softmax weights its attention computed
        (:func:`~velox_keyformer.score.gumbel_weights`: their logarithm is the logits up to
        each query's constant, which the Gumbel softmax does not see), with the next noise
        draw, of the shape :meth:`votes` draws."""
        b, h, r, n, t = weights.shape
        g = self.noise((b, h * r, n, t))
        return gumbel_weights(weights, self.tau, g)

    # -- state: "scores" and "key" (SeededDraws); meta seen, draws and step -------------------
    def meta(self) -> Any:
        return {**super().meta(), "step": self._step}

    def set_state(self, state: dict[str, mx.array], meta: Any) -> None:
        super().set_state(state, meta)
        self._step = int((meta or {}).get("step", 0))
