"""velox-gear: GEAR, low-bit codes + a low-rank residual + sparse outliers (arXiv 2403.05527)."""

from velox_core import Method

from .cache import GearCache
from .codec import GearCodec
from .config import GearConfig
from .parts import lowrank, outlier_index

__all__ = ["METHOD", "GearCache", "GearCodec", "GearConfig", "lowrank", "outlier_index"]

METHOD = Method.of(
    GearCache,
    summary="KIVI codes (keys per channel, values per token) + a low-rank approximation of "
    "the quantization residual + 2% sparse outliers kept exactly, in 64-token blocks",
    paper="https://arxiv.org/abs/2403.05527",
    codecs=(GearCodec,),
    recommended=({"bits": 4}, {"bits": 2}),
)
