"""velox-streamingllm: attention sinks plus recent tokens (arXiv 2309.17453)."""

from velox_core.cache.eviction import RECOMMENDED_DEFAULT_GROUP, eviction_method

from .cache import StreamingLLMCache
from .config import StreamingLLMConfig

__all__ = ["METHOD", "StreamingLLMCache", "StreamingLLMConfig"]

METHOD = eviction_method(
    StreamingLLMCache,
    summary="attention sinks plus a rolling window of recent tokens; older tokens evicted",
    paper="https://arxiv.org/abs/2309.17453",
    recommended=RECOMMENDED_DEFAULT_GROUP,
)
