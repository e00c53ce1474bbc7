"""velox-nsnquant: NSNQuant, the normalize-shift-normalize transform and a Hadamard rotation
before one synthetic-Gaussian vector-quantization codebook shared by every model
(calibration-free; arXiv 2505.18231)."""

from velox_core import Method

from .cache import NSNQuantCache
from .codebook import codebook, subvector, train
from .codec import NSNQuantCodec
from .config import NSNQuantConfig
from .transform import Rotation, nsn

__all__ = [
    "METHOD",
    "NSNQuantCache",
    "NSNQuantCodec",
    "NSNQuantConfig",
    "Rotation",
    "codebook",
    "nsn",
    "subvector",
    "train",
]

METHOD = Method.of(
    NSNQuantCache,
    summary="tokens normalized, block-centred, normalized again and Hadamard-rotated onto a "
    "standard normal law, then vector-quantized with one codebook fitted on synthetic Gaussian "
    "vectors (no calibration)",
    paper="https://arxiv.org/abs/2505.18231",
    codecs=(NSNQuantCodec,),
    recommended=({"bits": 2}, {"bits": 4}, {"bits": 1}),
)
