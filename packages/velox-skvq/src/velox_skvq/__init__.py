"""velox-skvq: SKVQ, sliding-window KV-cache quantization (arXiv 2405.06219)."""

from velox_core import Method

from .cache import SKVQCache
from .codec import SKVQ
from .config import SKVQConfig

__all__ = ["METHOD", "SKVQ", "SKVQCache", "SKVQConfig"]

METHOD = Method.of(
    SKVQCache,
    summary="reordered channels, clipped dynamic group quantization, fp16 window and sinks",
    paper="https://arxiv.org/abs/2405.06219",
    codecs=(SKVQ,),
    recommended=(
        {"bits": 4, "key_group": 64, "value_group": 128, "window": 0, "sinks": 0},
        {"bits": 3, "key_group": 64, "value_group": 128, "window": 128, "sinks": 5},
        {"bits": 2, "key_group": 64, "value_group": 128, "window": 128, "sinks": 5},
        {
            "key_bits": 2,
            "value_bits": 1.5,
            "key_group": 64,
            "value_group": 128,
            "window": 128,
            "sinks": 5,
        },
    ),
)
