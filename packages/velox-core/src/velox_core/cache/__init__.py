"""Caches: segments of coded tokens behind the mlx-lm cache protocol."""

from .attention import Segment, attend, decode_segments
from .batch import VeloxBatch
from .store import PackedStore
from .velox import Tier, VeloxCache

VeloxCache._batch_class = VeloxBatch  # what VeloxCache.merge builds

__all__ = [
    "PackedStore",
    "Segment",
    "Tier",
    "VeloxBatch",
    "VeloxCache",
    "attend",
    "decode_segments",
]
