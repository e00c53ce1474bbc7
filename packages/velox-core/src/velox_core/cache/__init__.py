"""Caches: segments of coded tokens behind the mlx-lm cache protocol."""

from .batch import VeloxBatch
from .velox import VeloxCache

VeloxCache._batch_class = VeloxBatch  # what VeloxCache.merge builds

__all__: list[str] = []
