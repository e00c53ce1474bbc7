"""velox-turboquant: TurboQuant, online vector quantization with near-optimal distortion
(arXiv 2504.19874), as a KV-cache codec for velox."""

from velox_core import Method

from .cache import TurboQuantCache
from .codec import TurboQuant
from .config import TurboQuantConfig
from .quantizer import SphereQuantizer

__all__ = ["METHOD", "SphereQuantizer", "TurboQuant", "TurboQuantCache", "TurboQuantConfig"]

METHOD = Method.of(
    TurboQuantCache,
    summary="random rotation + Lloyd-Max codes on the sphere law; QJL residual for unbiased q.k",
    paper="https://arxiv.org/abs/2504.19874",
    codecs=(TurboQuant,),
    recommended=(
        {"bits": 4},
        {"bits": 3.5},
        {"bits": 3},
        {"bits": 2.5},
        {"bits": 2},
    ),
)
