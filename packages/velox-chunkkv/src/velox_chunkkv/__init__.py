"""velox-chunkkv: ChunkKV, keep whole chunks of consecutive tokens (arXiv 2502.00299)."""

from velox_core.cache.eviction import RECOMMENDED_VOTED, eviction_method

from .cache import ChunkKVCache
from .chunks import select_chunks
from .config import ChunkKVConfig
from .policy import ChunkKVPolicy

__all__ = ["METHOD", "ChunkKVCache", "ChunkKVConfig", "ChunkKVPolicy", "select_chunks"]

METHOD = eviction_method(
    ChunkKVCache,
    summary="whole chunks of consecutive tokens, ranked by an observation window's votes "
    "(the same chunks in every KV head; optional layer-wise index reuse); rest evicted",
    paper="https://arxiv.org/abs/2502.00299",
    recommended=RECOMMENDED_VOTED,
)
