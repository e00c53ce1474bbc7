"""velox-h2o: keep the heavy hitters of accumulated attention and the recent tokens
(arXiv 2306.14048)."""

from velox_core.cache.eviction import eviction_method

from .cache import H2OCache
from .config import H2OConfig
from .policy import H2OPolicy

__all__ = ["METHOD", "H2OCache", "H2OConfig", "H2OPolicy"]

METHOD = eviction_method(
    H2OCache,
    summary="heavy hitters of accumulated attention plus the recent tokens, per KV head; "
    "one eviction per step",
    paper="https://arxiv.org/abs/2306.14048",
)
