"""velox-snapkv: SnapKV, keep what the observation window votes for (arXiv 2404.14469)."""

from velox_core.cache.eviction import RECOMMENDED_VOTED, eviction_method
from velox_core.policy import pool_votes, window_votes

from .cache import SnapKVCache
from .config import SnapKVConfig
from .policy import SnapKVPolicy

__all__ = ["METHOD", "SnapKVCache", "SnapKVConfig", "SnapKVPolicy", "pool_votes", "window_votes"]

METHOD = eviction_method(
    SnapKVCache,
    summary="prompt tokens voted by an observation window (pooled), per KV head; rest evicted",
    paper="https://arxiv.org/abs/2404.14469",
    recommended=RECOMMENDED_VOTED,
)
