"""velox-pyramidkv: PyramidKV, per-layer budgets falling with depth (arXiv 2406.02069)."""

from velox_core.cache.eviction import RECOMMENDED_VOTED, eviction_method

from .cache import PyramidKVCache
from .config import PyramidKVConfig
from .policy import PyramidKVPolicy
from .schedule import layer_budget, layer_budgets

__all__ = [
    "METHOD",
    "PyramidKVCache",
    "PyramidKVConfig",
    "PyramidKVPolicy",
    "layer_budget",
    "layer_budgets",
]

METHOD = eviction_method(
    PyramidKVCache,
    summary="per-layer budgets falling with depth (a pyramid averaging budget), SnapKV "
    "observation-window votes within each layer; rest evicted",
    paper="https://arxiv.org/abs/2406.02069",
    recommended=RECOMMENDED_VOTED,
)
