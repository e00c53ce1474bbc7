"""velox-kitty: Kitty, 2-bit keys per channel with the top channels of each page boosted to
4 bits, 2-bit values per token (arXiv 2511.18643)."""

from velox_core import Method, Uniform

from .cache import KittyCache
from .codec import SCORES, KittyKeys, boosted_count
from .config import KittyConfig

__all__ = ["METHOD", "SCORES", "KittyCache", "KittyConfig", "KittyKeys", "boosted_count"]

METHOD = Method.of(
    KittyCache,
    summary="2-bit keys per channel in 128-token pages, each page's top-magnitude 25% of "
    "channels boosted to 4 bits; 2-bit values per token; fp16 sinks and window",
    paper="https://arxiv.org/abs/2511.18643",
    codecs=(KittyKeys, Uniform),
    recommended=({}, {"score": "variance"}),
)
