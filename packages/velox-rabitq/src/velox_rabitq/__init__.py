"""velox-rabitq: RaBitQ and extended RaBitQ keys with an unbiased inner-product estimator
(arXiv 2405.12497, 2409.09913)."""

from velox_core import Method, Uniform

from .cache import RaBitQCache
from .codec import EPS0, RaBitQ
from .config import RaBitQConfig
from .quantizer import quantize

__all__ = ["EPS0", "METHOD", "RaBitQ", "RaBitQCache", "RaBitQConfig", "quantize"]

METHOD = Method.of(
    RaBitQCache,
    summary="rotated keys as RaBitQ sign / extended codes + norm, <o_bar,o> (unbiased scores)",
    paper="https://arxiv.org/abs/2405.12497",
    codecs=(RaBitQ, Uniform),
    recommended=({"bits": 4}, {"bits": 2}),
)
