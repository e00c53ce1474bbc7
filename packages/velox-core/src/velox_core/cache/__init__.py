"""Caches: segments of coded tokens behind the mlx-lm cache protocol."""

from .attention import Segment, attend, decode_segments
from .store import PackedStore
from .velox import Tier, VeloxCache

__all__ = ["PackedStore", "Segment", "Tier", "VeloxCache", "attend", "decode_segments"]
