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

How it runs in velox: the policy keeps one float32 score per stored token and KV head,
``(B, H, S)``, in the cache's storage order (sinks, body, window). After each
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

from typing import Any

import mlx.core as mx

from velox_core import RetentionPolicy
from velox_core.policy import top_k_sorted, window_votes
from velox_core.validation import check_int

__all__ = ["SCORE_ELEMENTS", "H2OPolicy"]

# attention weights formed at once when a chunk of queries is scored: the queries are taken
# in blocks of SCORE_ELEMENTS // (B * Hq * stored tokens)
SCORE_ELEMENTS = 1 << 20


class H2OPolicy(RetentionPolicy):
    """H2O's retention policy: accumulated attention per KV head, plus a recent window.

    Args:
        budget: tokens kept per KV head (sinks, heavy hitters, recent tokens), or None.
        every: during decode, cut once the cache holds ``budget + every`` tokens (1: the
            paper, one token per step; None: only after prefill chunks).
        recent: the newest tokens always kept (the paper's recent window), in tokens; the
            cache's ``window`` counts among them.
    """

    name = "h2o"
    settings = ("recent",)

    def __init__(self, budget: int | None = None, every: int | None = 1, recent: int = 0):
        super().__init__(budget, every)
        self.recent = check_int("recent", recent, minimum=0)
        self._scores: mx.array | None = None  # (B, H, S) float32, in the cache's order
        self._seen = 0  # every stored token before this position has been attended

    def attach(self, cache) -> None:
        super().attach(cache)
        always = cache.sinks + max(cache.window, self.recent)
        if self.budget is not None and self.budget <= always:
            raise ValueError(
                f"budget={self.budget} must exceed sinks + max(window, recent) = {always} "
                "(those tokens are always kept, and at least one heavy hitter must fit)"
            )

    # -- the scores follow the stored tokens -------------------------------------------------
    def _sync(self, cache) -> None:
        """Align the scores with the stored tokens: a trim drops the newest stored tokens
        (the last of the storage order), and their scores with them."""
        n = cache.size()
        if self._scores is None:
            if n:
                raise ValueError(f"h2o: the cache stores {n} tokens but holds no scores")
            return
        s = self._scores.shape[2]
        if n < s:
            self._scores = self._scores[:, :, :n]
        elif n > s:
            raise ValueError(f"h2o: the scores cover {s} tokens, the cache stores {n}")
        self._seen = min(self._seen, cache.offset)

    def before_update(self, cache, incoming: int) -> None:
        if self.budget is not None:
            self._sync(cache)
        super().before_update(cache, incoming)

    def after_update(self, cache, start: int) -> None:
        """The tokens just stored start with a score of zero."""
        if self.budget is None:
            return
        b, h = cache._dims[:2]
        new = mx.zeros((b, h, cache.offset - start), dtype=mx.float32)
        old = self._scores
        self._scores = new if old is None else mx.concatenate([old, new], axis=2)

    # -- accumulating ------------------------------------------------------------------------
    def observe(self, cache, queries: mx.array, scale: float) -> None:
        """Add the softmax weights of this call's queries (the newest stored positions) over
        every stored token to the scores, in blocks of queries."""
        if self.budget is None:
            return
        self._sync(cache)
        keys, _ = cache.keys_and_values()  # sinks | body | window, decoded: (B, H, S, D)
        k_pos = self._stored_positions(cache)
        b, hq, n, _ = queries.shape
        first = cache.offset - n  # position of this call's first query
        block = max(1, SCORE_ELEMENTS // max(1, b * hq * keys.shape[2]))
        acc = self._scores
        for i in range(0, n, block):
            j = min(i + block, n)
            q_pos = mx.arange(first + i, first + j, dtype=mx.int32)
            acc = acc + window_votes(queries[:, :, i:j], q_pos, keys, k_pos, scale)
            if j < n:
                mx.eval(acc)  # one block's weights at a time
        self._scores = acc
        self._seen = cache.offset
        mx.async_eval(acc)  # detach from the call's graph (no chain across steps)

    @staticmethod
    def _stored_positions(cache) -> mx.array:
        """Absolute position of every stored token, in storage order: int32 ``(B, H, S)``."""
        b, h = cache._dims[:2]
        n_sink = cache.sink_count()
        parts = [mx.broadcast_to(mx.arange(n_sink, dtype=mx.int32), (b, h, n_sink))]
        body = cache.body_positions()
        t = 0
        if all(p is not None for p in body):
            parts.append(mx.stack(body, axis=1).astype(mx.int32))
            t = parts[-1].shape[2]
        n_win = cache.size() - n_sink - t
        win = mx.arange(cache.offset - n_win, cache.offset, dtype=mx.int32)
        parts.append(mx.broadcast_to(win, (b, h, n_win)))
        return mx.concatenate(parts, axis=2)

    # -- choosing ----------------------------------------------------------------------------
    def score(self, cache) -> list[mx.array | None]:
        """Per KV head ``(B, T)`` float32: each body token's accumulated attention; the
        recent tokens ``+inf``; tokens no query has attended above every scored token, the
        newest highest."""
        pos = cache.body_positions()
        if any(p is None for p in pos):
            return pos
        s = self._body_scores(cache, mx.stack(pos, axis=1))
        return [s[:, h] for h in range(s.shape[1])]

    def _body_scores(self, cache, body_pos: mx.array) -> mx.array:
        self._sync(cache)
        if cache.offset > self._seen and not cache.routed:
            raise ValueError(
                "h2o: the attention every query gives each token chooses the tokens to keep, "
                "and only velox attention sees the queries: run the model inside "
                "velox_core.routed(model) (velox_core.generate does)"
            )
        n_sink, t = cache.sink_count(), body_pos.shape[2]
        acc = self._scores[:, :, n_sink : n_sink + t]
        unseen = body_pos >= self._seen
        above = mx.max(acc, axis=2, keepdims=True) + 1.0  # above every accumulated score
        s = mx.where(unseen, above + (body_pos - self._seen).astype(mx.float32), acc)
        return mx.where(body_pos >= cache.offset - self.recent, mx.inf, s)

    def select(self, cache, k: int):
        """The top ``k`` body tokens per KV head, ``(B, H, k)``; their scores are kept."""
        pos = cache.body_positions()
        if any(p is None for p in pos):
            return mx.zeros((cache._dims[0], len(pos), 0), dtype=mx.int32)
        body_pos = mx.stack(pos, axis=1)
        idx = top_k_sorted(self._body_scores(cache, body_pos), k)
        n_sink, t, acc = cache.sink_count(), body_pos.shape[2], self._scores
        kept = mx.take_along_axis(acc[:, :, n_sink : n_sink + t], idx, axis=2)
        self._scores = mx.concatenate([acc[:, :, :n_sink], kept, acc[:, :, n_sink + t :]], axis=2)
        return idx

    # -- batch rows (called by VeloxCache.filter / extend) -------------------------------------
    def filter_batch(self, idx: mx.array) -> None:
        if self._scores is not None:
            self._scores = self._scores[idx]

    def extend_batch(self, other: H2OPolicy) -> None:
        a, b = self._scores, other._scores
        if a is None and b is None:
            return
        if a is None or b is None or a.shape[1:] != b.shape[1:]:
            raise ValueError("h2o: extend needs caches whose scores cover the same tokens")
        self._scores = mx.concatenate([a, b], axis=0)
        self._seen = min(self._seen, other._seen)  # tokens unseen by a row count as unseen

    # -- state: {"scores": (B, H, S) float32}, meta "seen" (positions before it attended) ------
    def state(self) -> dict[str, mx.array]:
        return {} if self._scores is None else {"scores": self._scores}

    def meta(self) -> Any:
        return {**super().meta(), "seen": self._seen}

    def set_state(self, state: dict[str, mx.array], meta: Any) -> None:
        state = dict(state)
        scores = state.pop("scores", None)
        if scores is not None and (scores.ndim != 3 or scores.dtype != mx.float32):
            raise ValueError(
                f"h2o: the accumulated scores must be float32 (B, H, S), got {scores.dtype} "
                f"{tuple(scores.shape)}"
            )
        super().set_state(state, meta)
        self._scores = scores
        self._seen = int((meta or {}).get("seen", 0))
