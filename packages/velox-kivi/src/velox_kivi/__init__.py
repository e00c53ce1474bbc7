"""velox-kivi: KIVI, tuning-free asymmetric 2/4-bit KV quantization (arXiv 2402.02750)."""

from velox_core import Method, Uniform

from .cache import KIVICache
from .config import KIVIConfig

__all__ = ["METHOD", "KIVICache", "KIVIConfig"]

METHOD = Method.of(
    KIVICache,
    summary="keys per channel, values per token, 2/4-bit asymmetric, fp16 residual window",
    paper="https://arxiv.org/abs/2402.02750",
    codecs=(Uniform,),
    recommended=({"bits": 4, "group": 64, "window": 0}, {"bits": 2, "group": 32, "window": 128}),
)
