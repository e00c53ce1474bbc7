"""velox-kvsink: KVSink, predicted attention sinks kept exact in KIVI-style KV quantization
(arXiv 2508.04257)."""

from velox_core import Method, Uniform

from .cache import KVSinkCache
from .config import KVSinkConfig
from .predict import outlier_scores, select_sinks

__all__ = ["METHOD", "KVSinkCache", "KVSinkConfig", "outlier_scores", "select_sinks"]

METHOD = Method.of(
    KVSinkCache,
    summary="KIVI codes; predicted attention sinks (value/key-norm outliers) kept exact",
    paper="https://arxiv.org/abs/2508.04257",
    codecs=(Uniform,),
    recommended=(
        {"bits": 4, "group": 64, "window": 0, "sinks": 0, "outlier": 2.0, "max_sinks": 8},
        {"bits": 2, "group": 32, "window": 128, "sinks": 0, "outlier": 2.0, "max_sinks": 8},
    ),
)
