"""velox-zipcache: ZipCache, per-token precision from normalized-attention saliency
(arXiv 2405.14256)."""

from velox_core import Method

from .blocks import MixedBlocks, locality, salient_count
from .cache import ZipCacheCache
from .codec import MixedChannel, MixedSeparable
from .config import KEY_AXES, SCORES, ZipCacheConfig
from .saliency import normalized_scores, probe_rows, top_per_block

__all__ = [
    "KEY_AXES",
    "METHOD",
    "SCORES",
    "MixedBlocks",
    "MixedChannel",
    "MixedSeparable",
    "ZipCacheCache",
    "ZipCacheConfig",
    "locality",
    "normalized_scores",
    "probe_rows",
    "salient_count",
    "top_per_block",
]

METHOD = Method.of(
    ZipCacheCache,
    summary="per-token precision: in each 100-token block the 60% of tokens with the highest "
    "normalized attention (probe queries) at 4 bits, the rest at 2; keys per channel, values "
    "channel-separable tokenwise",
    paper="https://arxiv.org/abs/2405.14256",
    codecs=(MixedChannel, MixedSeparable),
    recommended=({},),
)
