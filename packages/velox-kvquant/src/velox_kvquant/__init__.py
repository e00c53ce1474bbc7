"""velox-kvquant: KVQuant, per-channel pre-RoPE keys, nuq datatypes, dense-and-sparse
outliers and an fp16 attention sink (arXiv 2401.18079)."""

from velox_core import Method
from velox_core.ops.rope import RopeSpec, find_rope, rope_spec, rotate

from .cache import KVQuantCache
from .config import KVQuantConfig
from .keys import KVQuantKeys
from .values import KVQuantValues

__all__ = [
    "METHOD",
    "KVQuantCache",
    "KVQuantConfig",
    "KVQuantKeys",
    "KVQuantValues",
    "RopeSpec",
    "find_rope",
    "rope_spec",
    "rotate",
]

METHOD = Method.of(
    KVQuantCache,
    summary="per-channel pre-RoPE keys, per-token values, nuq datatypes, 1% sparse outliers",
    paper="https://arxiv.org/abs/2401.18079",
    codecs=(KVQuantKeys, KVQuantValues),
    recommended=({"bits": 4}, {"bits": 3}, {"bits": 2}),
)
