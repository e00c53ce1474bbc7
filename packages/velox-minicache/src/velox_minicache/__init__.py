"""velox-minicache: MiniCache, KV-cache compression in the depth dimension: adjacent layers
from the middle of the model down share SLERP-merged token directions with per-layer
magnitudes, and keep their most distinct tokens unmerged (arXiv 2405.14366)."""

from velox_core import Method

from .cache import MiniCache
from .codec import MergedStates
from .config import MiniCacheConfig
from .merge import distance_range, restore, retained, slerp_merge
from .pair import MergedPair

__all__ = [
    "METHOD",
    "MergedPair",
    "MergedStates",
    "MiniCache",
    "MiniCacheConfig",
    "distance_range",
    "restore",
    "retained",
    "slerp_merge",
]

METHOD = Method.of(
    MiniCache,
    summary="cross-layer merging: adjacent layers share SLERP token directions, own magnitudes",
    paper="https://arxiv.org/abs/2405.14366",
    recommended=({"t": 0.5, "gamma": 0.05},),
)
