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

How it runs in velox: one float32 score per stored token and KV head, ``(B, H, S)``, in the
cache's storage order; new tokens start at zero (:meth:`KeyformerPolicy.after_update`);
:meth:`KeyformerPolicy.observe` (called by ``VeloxCache.attend`` with the post-RoPE queries,
so only inside ``velox_core.routed(model)`` or ``velox_core.generate``) adds the queries'
Gumbel scores, in blocks of at most :data:`SCORE_ELEMENTS` scores. A call of several
queries (a prompt chunk) scores at ``tau_init`` and restarts the schedule, as the authors'
prompt does; each call of one query is a decode step. The cut (velox-core's
``before_update``: after a prefill chunk, and during decode once the cache holds ``budget +
every`` tokens) keeps per KV head the ``recent`` newest tokens and the top of the rest by
accumulated score; the kept tokens keep their scores.

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

from velox_core import RetentionPolicy
from velox_core.policy import top_k_sorted
from velox_core.validation import check_float, check_int

from .score import gumbel_votes, temperature

__all__ = ["SCORE_ELEMENTS", "KeyformerPolicy", "layer_key"]

# scores formed at once when a chunk of queries is scored
SCORE_ELEMENTS = 1 << 20


def layer_key(seed: int, layer: int | None) -> mx.array:
    """The noise's first key for one layer: the ``layer``-th of ``seed``'s split keys."""
    i = layer or 0
    return mx.random.split(mx.random.key(seed), i + 1)[i]


class KeyformerPolicy(RetentionPolicy):
    """Keyformer's retention policy: accumulated Gumbel scores per KV head, a recent window.

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
        super().__init__(budget, every)
        self.recent = check_int("recent", recent, minimum=0)
        self.tau_init = check_float("tau_init", tau_init, minimum=1e-6)
        self.tau_end = check_float("tau_end", tau_end, minimum=1e-6)
        self.steps = check_int("steps", steps, minimum=1)
        self.seed = check_int("seed", seed, minimum=0)
        self._key = layer_key(self.seed, None)
        self._draws = 0  # noise draws so far
        self._step = 0  # decode steps since the last prompt chunk
        self._scores: mx.array | None = None  # (B, H, S) float32, in the cache's order
        self._seen = 0  # every stored token before this position has been scored

    def attach(self, cache) -> None:
        super().attach(cache)
        always = cache.sinks + max(cache.window, self.recent)
        if self.budget is not None and self.budget <= always:
            raise ValueError(
                f"budget={self.budget} must exceed sinks + max(window, recent) = {always} "
                "(those tokens are always kept, and at least one key token must fit)"
            )

    def bind(self, model: Any = None, layer: int | None = None) -> None:
        if self._draws == 0:  # each layer its own noise
            self._key = layer_key(self.seed, layer)

    @property
    def tau(self) -> float:
        """The temperature of the next scores: the schedule at the current decode step."""
        return temperature(self._step, self.tau_init, self.tau_end, self.steps)

    def noise(self, shape: tuple[int, ...]) -> mx.array:
        """The next Gumbel(0, 1) draw: the key is split, one half kept, one half drawn."""
        keys = mx.random.split(self._key)
        self._key, self._draws = keys[0], self._draws + 1
        return mx.random.gumbel(shape=shape, key=keys[1])

    # -- the scores follow the stored tokens -------------------------------------------------
    def _sync(self, cache) -> None:
        """Align the scores with the stored tokens (a trim drops the newest)."""
        n = cache.size()
        if self._scores is None:
            if n:
                raise ValueError(f"keyformer: the cache stores {n} tokens but holds no scores")
            return
        s = self._scores.shape[2]
        if n < s:
            self._scores = self._scores[:, :, :n]
        elif n > s:
            raise ValueError(f"keyformer: the scores cover {s} tokens, the cache stores {n}")
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

    def observe(self, cache, queries: mx.array, scale: float) -> None:
        """Add this call's queries' Gumbel scores over every stored token, in blocks."""
        if self.budget is None:
            return
        self._sync(cache)
        b, hq, n, _ = queries.shape
        self._step = 0 if n > 1 else self._step + 1
        tau = self.tau
        keys, _ = cache.keys_and_values()  # (B, H, S, D), storage order
        k_pos = self._stored_positions(cache)
        first, s = cache.offset - n, keys.shape[2]
        block = max(1, SCORE_ELEMENTS // max(1, b * hq * s))
        acc = self._scores
        for i in range(0, n, block):
            j = min(i + block, n)
            q_pos = mx.arange(first + i, first + j, dtype=mx.int32)
            g = self.noise((b, hq, j - i, s))
            acc = acc + gumbel_votes(queries[:, :, i:j], q_pos, keys, k_pos, scale, tau, g)
            if j < n:
                mx.eval(acc)
        self._scores = acc
        self._seen = cache.offset
        mx.async_eval(acc, self._key)  # detach from the call's graph

    @staticmethod
    def _stored_positions(cache) -> mx.array:
        """Absolute position of every stored token, in storage order: int32 ``(B, H, S)``."""
        b, h = cache._dims[:2]
        n_sink = cache.sink_count()
        parts = [mx.broadcast_to(mx.arange(n_sink, dtype=mx.int32), (b, h, n_sink))]
        body, t = cache.body_positions(), 0
        if all(p is not None for p in body):
            parts.append(mx.stack(body, axis=1).astype(mx.int32))
            t = parts[-1].shape[2]
        n_win = cache.size() - n_sink - t
        win = mx.arange(cache.offset - n_win, cache.offset, dtype=mx.int32)
        parts.append(mx.broadcast_to(win, (b, h, n_win)))
        return mx.concatenate(parts, axis=2)

    # -- choosing ----------------------------------------------------------------------------
    def score(self, cache) -> list[mx.array | None]:
        """Per KV head ``(B, T)`` float32: each body token's accumulated score; the recent
        tokens ``+inf``; tokens no query has scored above every scored token, newest
        highest."""
        pos = cache.body_positions()
        if any(p is None for p in pos):
            return pos
        s = self._body_scores(cache, mx.stack(pos, axis=1))
        return [s[:, h] for h in range(s.shape[1])]

    def _body_scores(self, cache, body_pos: mx.array) -> mx.array:
        self._sync(cache)
        if cache.offset > self._seen and not cache.routed:
            raise ValueError(
                "keyformer: the scores every query gives each token choose the tokens to "
                "keep, and only velox attention sees the queries: run the model inside "
                "velox_core.routed(model) (velox_core.generate does)"
            )
        n_sink, t = cache.sink_count(), body_pos.shape[2]
        acc = self._scores[:, :, n_sink : n_sink + t]
        unseen = body_pos >= self._seen
        above = mx.max(acc, axis=2, keepdims=True) + 1.0
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

    # -- batch rows --------------------------------------------------------------------------
    def filter_batch(self, idx: mx.array) -> None:
        if self._scores is not None:
            self._scores = self._scores[idx]

    def extend_batch(self, other: KeyformerPolicy) -> None:
        a, b = self._scores, other._scores
        if a is None and b is None:
            return
        if a is None or b is None or a.shape[1:] != b.shape[1:]:
            raise ValueError("keyformer: extend needs caches whose scores cover the same tokens")
        self._scores = mx.concatenate([a, b], axis=0)
        self._seen = min(self._seen, other._seen)

    # -- state: "scores" (B, H, S) float32, "key" uint32 (2,); meta seen, step, draws --------
    def state(self) -> dict[str, mx.array]:
        # an empty cache holds nothing: the key is saved with the first scores
        return {} if self._scores is None else {"scores": self._scores, "key": self._key}

    def meta(self) -> Any:
        return {**super().meta(), "seen": self._seen, "step": self._step, "draws": self._draws}

    def set_state(self, state: dict[str, mx.array], meta: Any) -> None:
        state = dict(state)
        scores, key = state.pop("scores", None), state.pop("key", None)
        if scores is not None and (scores.ndim != 3 or scores.dtype != mx.float32):
            raise ValueError(
                "keyformer: the accumulated scores must be float32 (B, H, S), got "
                f"{scores.dtype} {tuple(scores.shape)}"
            )
        if scores is not None and (key is None or key.shape != (2,) or key.dtype != mx.uint32):
            got = None if key is None else f"{key.dtype} {tuple(key.shape)}"
            raise ValueError(f"keyformer: the noise key must be uint32 (2,), got {got}")
        super().set_state(state, meta)
        meta = meta or {}
        self._scores = scores
        self._key = layer_key(self.seed, None) if key is None else key
        self._seen, self._step = int(meta.get("seen", 0)), int(meta.get("step", 0))
        self._draws = int(meta.get("draws", 0))
