"""velox-tova: evict what the last query attends to least, heads averaged (arXiv 2401.06104)."""

from velox_core.cache.eviction import eviction_method

from .cache import TOVACache
from .config import TOVAConfig
from .policy import TOVAPolicy

__all__ = ["METHOD", "TOVACache", "TOVAConfig", "TOVAPolicy"]

METHOD = eviction_method(
    TOVACache,
    summary="tokens the last query attends to most, averaged over heads; one eviction per step",
    paper="https://arxiv.org/abs/2401.06104",
)
