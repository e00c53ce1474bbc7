"""velox-polarquant: PolarQuant, KV caches quantized in polar coordinates after a random
rotation (arXiv 2502.02617)."""

from velox_core import Method

from .cache import PolarQuantCache
from .codebook import angle_density, level_codebook
from .codec import PolarQuant
from .config import PolarQuantConfig
from .polar import from_polar, to_polar
from .rotation import Rotation

__all__ = [
    "METHOD",
    "PolarQuant",
    "PolarQuantCache",
    "PolarQuantConfig",
    "Rotation",
    "angle_density",
    "from_polar",
    "level_codebook",
    "to_polar",
]

METHOD = Method.of(
    PolarQuantCache,
    summary="random rotation, recursive polar transform over pairs (4 levels), fp16 block "
    "radii and angles coded with level-specific codebooks of their known laws (4 bits at "
    "level 1, 2 above): keys and values",
    paper="https://arxiv.org/abs/2502.02617",
    codecs=(PolarQuant,),
    recommended=({"bits": 4}, {"bits": 5}, {"bits": 3}),
)
