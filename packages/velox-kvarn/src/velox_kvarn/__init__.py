"""velox-kvarn: KVarN, Hadamard rotation and dual-axis variance normalization of each tile
before round-to-nearest codes (arXiv 2606.03458)."""

from velox_core import Method

from .cache import KVarNCache
from .codec import KVarNKeys, KVarNValues
from .config import KVarNConfig
from .normalize import imbalance, normalize
from .rotation import HadamardRotation

__all__ = [
    "METHOD",
    "HadamardRotation",
    "KVarNCache",
    "KVarNConfig",
    "KVarNKeys",
    "KVarNValues",
    "imbalance",
    "normalize",
]

METHOD = Method.of(
    KVarNCache,
    summary="Hadamard-rotated keys and values, each 128-token tile variance-normalized over "
    "tokens and channels (iterated), then rounded to nearest: keys per channel, values per "
    "token; fp16 sinks and the tile being filled",
    paper="https://arxiv.org/abs/2606.03458",
    codecs=(KVarNKeys, KVarNValues),
    recommended=({"key_bits": 4, "value_bits": 2}, {"bits": 4}, {"bits": 2}),
)
