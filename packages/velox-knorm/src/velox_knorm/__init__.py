"""velox-knorm: keep the tokens whose keys have the lowest L2 norm (arXiv 2406.11430)."""

from velox_core.cache.eviction import eviction_method

from .cache import KNormCache
from .config import KNormConfig
from .policy import KNormPolicy, key_norm_scores

__all__ = ["METHOD", "KNormCache", "KNormConfig", "KNormPolicy", "key_norm_scores"]

METHOD = eviction_method(
    KNormCache,
    summary="per KV head, the tokens whose keys have the lowest L2 norm; rest evicted",
    paper="https://arxiv.org/abs/2406.11430",
)
