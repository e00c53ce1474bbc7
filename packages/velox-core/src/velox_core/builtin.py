"""velox-core's own registered method: ``uniform``."""

from .cache.uniform import UniformCache
from .codec.uniform import Uniform
from .registry import Method

__all__ = ["UNIFORM"]

UNIFORM = Method(
    name="uniform",
    cache_class=UniformCache,
    summary="affine per-group codes (2-8 bits) for keys and values, attended from the codes",
    paper=None,
    codecs=(Uniform,),
    recommended=({"bits": 8}, {"bits": 4}, {"bits": 2}),
)
