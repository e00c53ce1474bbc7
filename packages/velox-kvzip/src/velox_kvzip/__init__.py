"""velox-kvzip: query-agnostic KV eviction by context reconstruction (arXiv 2505.23416)."""

from velox_core.cache.eviction import RECOMMENDED_DEFAULT_GROUP, eviction_method

from .cache import KVzipCache
from .compress import Compression, compress
from .config import KVzipConfig
from .policy import KVzipPolicy
from .score import chunk_scores

__all__ = [
    "METHOD",
    "Compression",
    "KVzipCache",
    "KVzipConfig",
    "KVzipPolicy",
    "chunk_scores",
    "compress",
]

METHOD = eviction_method(
    KVzipCache,
    summary="each KV pair scored by the attention it gets while the model reconstructs the "
    "context (velox_kvzip.compress after the prefill); the lowest evicted once, for any query",
    paper="https://arxiv.org/abs/2505.23416",
    recommended=RECOMMENDED_DEFAULT_GROUP,
)
