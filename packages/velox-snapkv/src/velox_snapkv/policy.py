"""``SnapKVPolicy``: keep the prompt tokens the observation window votes for (arXiv 2404.14469).

SnapKV observes that each attention head keeps attending, during generation, to the prompt
tokens that the last few prompt tokens (the *observation window*) attend to. So it lets the
window vote: the window's attention weights over the prefix, summed over its queries
(:func:`velox_core.policy.window_votes`), pooled along the tokens so that neighbours come
along (:func:`velox_core.policy.pool_votes`); each head keeps its top ``budget - protected``
prefix tokens plus the window itself.

How it runs in velox (velox-core's :class:`~velox_core.policy.WindowVotePolicy`, which this
policy is): :meth:`SnapKVPolicy.observe` keeps the newest ``observe`` queries it sees
(post-RoPE, as ``VeloxCache.attend`` passes them, so only inside
``velox_core.routed(model)`` or ``velox_core.generate``). velox-core calls
:meth:`~velox_core.RetentionPolicy.before_update` before the tokens after a prefill chunk
are stored; it cuts to ``budget`` with :meth:`SnapKVPolicy.score`, which computes the votes
of the kept queries over the tokens stored at that moment (so votes never go stale through
evictions, appends or trims). The newest ``observe`` tokens score ``+inf``, so the
observation window is never evicted. The kept queries are the policy's state (saved with the
cache, counted in ``nbytes``); without ``every`` they are dropped after the cut they vote
for, so decode holds no policy state.

Deviations from the paper (also in docs/snapkv.md):

* **Chunked prefill.** The paper compresses once, after the whole prompt, with the prompt's
  last ``window_size`` queries. Here every prefill chunk is followed by a cut voted by that
  chunk's last ``observe`` queries over what is stored (earlier survivors plus the chunk),
  so peak memory stays at ``budget`` plus one chunk; a token evicted by an early chunk's
  window cannot come back for a later one. A prompt that fits in one chunk gets exactly
  the paper's rule. mlx-lm's ``generate`` feeds the last prompt token as a step of
  its own: the window then ends one token before the prompt's end, and that token attends
  to the compressed cache.
* **GQA.** The authors' code repeats the KV heads up to the query heads and selects per
  query head (storing the repeated KV); here the votes of the query heads sharing a KV head
  are averaged, and each KV head keeps one selection.
* **Decode.** The paper does not evict generated tokens; with ``every`` set, the cache is
  cut again every ``every`` decode steps, voted by the latest ``observe`` queries.
* **No observed queries**: without routing a cut raises (no query can ever vote); routed
  but before any query reached the cache, a cut keeps the most recent tokens.
* Votes are computed from the stored keys, i.e. from their codes when the kept tokens are
  quantized; learned per-head sink logits (gpt-oss) are not part of the vote's softmax.
"""

from __future__ import annotations

from velox_core.policy import WindowVotePolicy

__all__ = ["SnapKVPolicy"]


class SnapKVPolicy(WindowVotePolicy):
    """SnapKV's retention policy.

    Args:
        budget: tokens kept per KV head (sinks, voted prefix and window), or None.
        every: during decode, cut again once the cache holds ``budget + every`` tokens
            (None: only after prefill chunks, as the paper).
        observe: size of the observation window (queries that vote, newest tokens kept).
        kernel: odd pooling kernel size along tokens (1: no pooling).
        pooling: ``"max"`` or ``"avg"``.
    """

    name = "snapkv"
