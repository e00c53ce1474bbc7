"""velox-streamingllm: attention sinks plus recent tokens (arXiv 2309.17453)."""

from velox_core import Method, RetentionPolicy, Uniform

from .cache import StreamingLLMCache
from .config import StreamingLLMConfig

__all__ = ["METHOD", "StreamingLLMCache", "StreamingLLMConfig"]

METHOD = Method(
    name="streamingllm",
    cache_class=StreamingLLMCache,
    summary="attention sinks plus a rolling window of recent tokens; older tokens evicted",
    paper="https://arxiv.org/abs/2309.17453",
    codecs=(Uniform,),
    policies=(RetentionPolicy,),
    recommended=({"budget": 1024}, {"budget": 1024, "bits": 4}),
)
