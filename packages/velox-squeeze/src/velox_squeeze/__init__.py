"""velox-squeeze: SqueezeAttention, per-layer budgets from layer importance (arXiv 2404.04793)."""

from velox_core.cache.eviction import RECOMMENDED_VOTED, eviction_method

from .allocate import Place, kmeans_1d, layer_budget, layer_budgets, places
from .cache import SqueezeCache
from .config import SqueezeConfig
from .observe import install, uninstall
from .policy import SqueezePolicy

__all__ = [
    "METHOD",
    "Place",
    "SqueezeCache",
    "SqueezeConfig",
    "SqueezePolicy",
    "install",
    "kmeans_1d",
    "layer_budget",
    "layer_budgets",
    "places",
    "uninstall",
]

METHOD = eviction_method(
    SqueezeCache,
    summary="per-layer budgets from each layer's importance (the cosine of the hidden states "
    "around its attention, layers clustered, the least important squeezed), SnapKV or "
    "StreamingLLM selection within each layer; rest evicted",
    paper="https://arxiv.org/abs/2404.04793",
    recommended=RECOMMENDED_VOTED,
)
