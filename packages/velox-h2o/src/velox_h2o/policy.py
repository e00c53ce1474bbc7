"""``H2OPolicy``: keep the heavy hitters of accumulated attention and the recent tokens
(arXiv 2306.14048).

H2O (Heavy-Hitter Oracle; Zhang et al., *H2O: Heavy-Hitter Oracle for Efficient Generative
Inference of Large Language Models*) observes that a small set of tokens collects most of
the attention, and that the attention a token has *accumulated* so far predicts the
attention it will get. Each head keeps, within its budget, the ``recent`` newest tokens and
the tokens with the largest accumulated attention (the heavy hitters): the sum, over every
query that has seen the token, of the softmax weight that query gave it. Once the cache is
full, each decode step stores its token, attends, adds its weights to the scores, and evicts
the lowest-scored token outside the recent window (greedily, one per step).

How it runs in velox (velox-core's :class:`~velox_core.policy.AccumulatedPolicy`, whose
votes here are attention weights): the policy keeps one float32 score per stored token and
KV head, ``(B, H, S)``, in the cache's storage order (sinks, body, window). After each
``update_and_fetch`` the new tokens start at zero (:meth:`H2OPolicy.after_update`);
:meth:`H2OPolicy.observe`, called by ``VeloxCache.attend`` with the layer's post-RoPE
queries before attention (so only inside ``velox_core.routed(model)`` or
``velox_core.generate``), adds those queries' softmax weights over every stored token
(:func:`velox_core.policy.window_votes`: each query normalized over all it can see,
causally; summed over the queries; averaged over the query heads of each KV head). A
prefill chunk is scored in blocks of queries, so at most :data:`SCORE_ELEMENTS` weights
exist at once. velox-core calls :meth:`~velox_core.RetentionPolicy.before_update` before
the next tokens are stored: after a prefill chunk, and during decode once the cache holds
``budget + every`` tokens (``every=1``: the paper's one eviction per step). The cut keeps,
per KV head, the ``recent`` newest tokens and the top of the rest by accumulated score
(:meth:`H2OPolicy.select`), and the scores of the kept tokens stay with them. Deferring the
paper's post-attention eviction to the next update keeps the same tokens: nothing is stored
or scored in between.

GQA: the authors' cache is per attention head (MHA). A KV head stores one set of tokens for
all its query heads, so its score is the mean of its query heads' weights (the mean over
the group, as velox's SnapKV votes and kvpress's presses combine them); the ranking equals
that of their sum. Each KV head keeps its own tokens, so a split by heads holds exactly its
share.

Deviations from the paper (also in docs/h2o.md):

* **Chunked prefill.** The authors' cache attends the whole prompt, accumulates every prompt
  query's weights and then reduces the cache once. Here each prefill chunk is followed by a
  cut (scores accumulated over the earlier chunks' queries and this chunk's), so peak
  memory stays at ``budget`` plus one chunk and a token dropped early cannot come back. A
  prompt in one chunk gets exactly the paper's rule.
* **``every`` > 1** evicts ``every`` tokens at once by the accumulated scores (the paper
  evicts one per step). ``every=None`` compresses the prompt only; decode queries still
  add to the scores, which a later prefill chunk's cut uses.
* **Unseen tokens.** Tokens no query has attended (stored by ``update_and_fetch`` without
  attention) rank above every scored token, the newest first. Without routing a cut that
  meets such tokens raises; routed but before any query reached the cache, a cut keeps the
  most recent tokens.
* **Trims** drop the trimmed tokens with their scores; the weights the trimmed queries gave
  older tokens stay on them.
* Scores accumulate in float32 (the authors' in the model's dtype) and per batch row (the
  authors' sum over the batch); weights come from the stored keys (their codes when
  ``bits`` is set); learned per-head sink logits (gpt-oss) are not part of their softmax.
"""

from __future__ import annotations

from velox_core.policy.accumulated import AttentionVotes

__all__ = ["SCORE_ELEMENTS", "H2OPolicy"]

# attention weights formed at once when a chunk of queries is scored: the queries are taken
# in blocks of SCORE_ELEMENTS // (B * Hq * stored tokens)
SCORE_ELEMENTS = 1 << 20


class H2OPolicy(AttentionVotes):
    """H2O's retention policy: accumulated attention per KV head, plus a recent window
    (velox-core's :class:`~velox_core.policy.AccumulatedPolicy`, voting by attention:
    :class:`~velox_core.policy.accumulated.AttentionVotes`).

    Args:
        budget: tokens kept per KV head (sinks, heavy hitters, recent tokens), or None.
        every: during decode, cut once the cache holds ``budget + every`` tokens (1: the
            paper, one token per step; None: only after prefill chunks).
        recent: the newest tokens always kept (the paper's recent window), in tokens; the
            cache's ``window`` counts among them.
    """

    name = "h2o"
    kept_name = "heavy hitter"

    @property
    def score_elements(self) -> int:
        return SCORE_ELEMENTS
