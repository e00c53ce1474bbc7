"""velox-curdkv: keep the tokens of highest value-guided leverage (arXiv 2509.15038)."""

from velox_core.cache.eviction import eviction_method

from .cache import CurDKVCache
from .config import CurDKVConfig
from .leverage import gaussian_sketch, leverage_scores, local_normalize
from .policy import CurDKVPolicy, body_values

__all__ = [
    "METHOD",
    "CurDKVCache",
    "CurDKVConfig",
    "CurDKVPolicy",
    "body_values",
    "gaussian_sketch",
    "leverage_scores",
    "local_normalize",
]

METHOD = eviction_method(
    CurDKVCache,
    summary="per KV head, the tokens of highest key-times-value leverage (approximate CUR); "
    "rest evicted",
    paper="https://arxiv.org/abs/2509.15038",
)
