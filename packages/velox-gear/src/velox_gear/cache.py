"""``GearCache``: GEAR's quantized backbone, low-rank residual and sparse outliers.

GEAR (arXiv 2403.05527) codes the cache a block of ``group`` tokens at a time (its
streaming buffer ``n_b``): the newest tokens wait in fp16 until a block is whole, then each
block is written as KIVI codes (keys per channel, values per token) + a rank-``rank``
approximation of the quantization residual + the block's ``outliers`` fraction of extreme
entries kept exactly (:class:`velox_gear.GearCodec`).

Deviations from the paper and the authors' code: outliers are ranked within one block of
one KV head (the code ranks each token across all heads for values and each channel along
the whole prefill for keys; the paper's ``s`` is kept as the fraction of entries); the
prefill is coded in blocks of ``n_b`` as the decode steps are (the code approximates the
whole prefill's residual at once, at its prefill rank, 4, and then decode blocks at rank
2: here one ``rank`` for both); every power iteration re-orthonormalizes (the code only its
last). Keys and values leave the fp16 buffer together, ``flush`` tokens at a time (velox's
default 64, whole blocks).
"""

from __future__ import annotations

from velox_core import Codec, PresetCache, config_fields

from .codec import GearCodec
from .config import GearConfig

__all__ = ["GearCache"]


class GearCache(PresetCache):
    """GEAR's cache for one layer. Parameters: see :class:`GearConfig`.

    Each KV head has its own blocks' factors and outliers, so a model split by heads holds
    exactly its heads' share.
    """

    method = "gear"
    Config = GearConfig

    def make_codecs(self, cfg: GearConfig, kb: int, vb: int) -> tuple[Codec, Codec]:
        own = config_fields(cfg, "group", "rank", "outliers", "iters", "seed")
        return GearCodec(kb, axis="channel", **own), GearCodec(vb, axis="token", **own)
