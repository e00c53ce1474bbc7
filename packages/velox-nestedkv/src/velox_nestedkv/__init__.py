"""velox-nestedkv: NestedKV, key-only eviction by multi-time-scale anomaly (arXiv 2605.26678)."""

from velox_core.cache.eviction import RECOMMENDED_DEFAULT_GROUP, eviction_method

from .cache import NestedKVCache
from .config import NestedKVConfig
from .policy import NestedKVPolicy
from .scores import NestedScore, cosine_anomaly, head_budgets, nested_score

__all__ = [
    "METHOD",
    "NestedKVCache",
    "NestedKVConfig",
    "NestedKVPolicy",
    "NestedScore",
    "cosine_anomaly",
    "head_budgets",
    "nested_score",
]

METHOD = eviction_method(
    NestedKVCache,
    summary="key-only eviction: stable/episodic/current cosine anomaly, head-adaptive budgets",
    paper="https://arxiv.org/abs/2605.26678",
    recommended=RECOMMENDED_DEFAULT_GROUP,
)
