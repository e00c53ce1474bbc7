"""velox-cam: keep the first and the newest tokens, and merge each evicted token's value into
the tokens kept after it (CaM, ICML 2024, https://proceedings.mlr.press/v235/zhang24n.html)."""

from velox_core.cache.eviction import eviction_method

from .cache import CamCache
from .config import CamConfig
from .merge import merge_probabilities, merged_values
from .policy import CamPolicy

__all__ = [
    "METHOD",
    "CamCache",
    "CamConfig",
    "CamPolicy",
    "merge_probabilities",
    "merged_values",
]

METHOD = eviction_method(
    CamCache,
    summary="the first and the newest tokens per KV head; each evicted value is merged into "
    "the tokens kept after it with a probability from accumulated attention (CaM)",
    paper="https://proceedings.mlr.press/v235/zhang24n.html",
)
