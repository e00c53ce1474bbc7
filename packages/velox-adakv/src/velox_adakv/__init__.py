"""velox-adakv: Ada-KV, head-wise adaptive budget allocation for KV eviction (arXiv 2407.11550)."""

from velox_core.cache.eviction import RECOMMENDED_VOTED, eviction_method

from .allocate import adaptive_keep, allocate
from .cache import AdaKVCache
from .config import AdaKVConfig
from .policy import AdaKVPolicy
from .scorer import ObservationWindow

__all__ = [
    "METHOD",
    "AdaKVCache",
    "AdaKVConfig",
    "AdaKVPolicy",
    "ObservationWindow",
    "adaptive_keep",
    "allocate",
]

METHOD = eviction_method(
    AdaKVCache,
    summary="head-wise adaptive budgets (joint top-k over heads, safeguard floor) over SnapKV",
    paper="https://arxiv.org/abs/2407.11550",
    recommended=RECOMMENDED_VOTED,
)
