"""``StreamingLLMCache``: attention sinks plus a window of the most recent tokens.

StreamingLLM observes that softmax attention dumps mass on the first tokens ("attention
sinks") whatever their content, so a model keeps working on endless streams when the cache
holds those few first tokens plus a rolling window of recent ones. Here the sinks are the
cache's fp16 ``sinks`` segment and the rolling window is velox-core's recency policy
(:class:`velox_core.RetentionPolicy`): older tokens are evicted and leave memory.

Positions: the paper re-assigns positions inside the cache (the window is re-encoded with
RoPE positions relative to the cache) for models trained on shorter contexts. mlx-lm applies
RoPE before the cache sees the keys, so velox keeps the original absolute positions (the
"no re-positioning" variant); ``offset`` stays the count of tokens seen. Eviction runs after
prefill chunks and every ``every`` decode steps (the paper evicts at every step). Kept tokens
may be coded with ``Uniform`` (``bits``), which the paper does not do.
"""

from __future__ import annotations

from velox_core import RetentionPolicy
from velox_core.cache.eviction import EvictionCache

from .config import StreamingLLMConfig

__all__ = ["StreamingLLMCache"]


class StreamingLLMCache(EvictionCache):
    """StreamingLLM's cache for one layer. Parameters: see :class:`StreamingLLMConfig`."""

    method = "streamingllm"
    Config = StreamingLLMConfig
    Policy = RetentionPolicy  # the most recent tokens, after the sinks
