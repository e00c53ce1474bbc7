"""``PolarQuantCache``: PolarQuant codes for keys and for values.

PolarQuant (arXiv 2502.02617) rotates every key and value by one random rotation, turns it
into polar coordinates by ``levels`` levels of a recursive transform over pairs, keeps the
``d / 2^levels`` radii in fp16 and codes each angle with the codebook of its level's known
law (:mod:`velox_polarquant.codec`). The paper codes keys and values alike (its Eq. 6
dequantizes both with the same procedure, and its rotation is shared by keys and values), so
both codecs here are PolarQuant, with the same settings.

Deviations from the paper (docs/polarquant.md):

- The rotation defaults to a randomized Hadamard transform (``d`` signs resident) instead of
  the paper's dense random rotation matrix (``rotation="haar"``: ``d^2`` float32 numbers for
  each layer's keys and values, which velox counts as resident bytes).
- The offline codebooks (the default) solve the paper's Eq. 4 exactly, by Lloyd's iteration
  on the angle laws, where the paper runs 1-D k-means++ on sampled angles. The online ones
  (``codebook="online"``) are fitted on the first tokens the cache codes (a prefill's first
  chunk), on at most 65,536 sampled angles a level, where the paper fits on the whole prompt.
- Codes are packed as one bit stream a level, in whole bytes (the paper: uint8 units).
- Generated tokens are coded like the prompt's (the paper's LongBench runs keep them in
  fp16; ``window`` keeps any number so). velox's ``flush``: with ``window=0`` up to
  ``flush - 1`` (63) of the newest tokens wait in fp16 until the next whole block is coded.
"""

from __future__ import annotations

from velox_core import Codec, PresetCache, config_fields

from .codec import PolarQuant
from .config import PolarQuantConfig

__all__ = ["PolarQuantCache"]


class PolarQuantCache(PresetCache):
    """PolarQuant's cache for one layer. Parameters: see :class:`PolarQuantConfig`.

    Each vector is coded on its own, so with the offline codebooks a model split by heads
    holds exactly its heads' share.
    """

    method = "polarquant"
    Config = PolarQuantConfig

    @classmethod
    def split_refusal(cls, config: dict, by_heads: bool, pipelined: bool) -> str:
        """Offline codebooks treat every KV head on its own; online ones are fitted on the
        angles of all the layer's heads together, which a process holding some heads cannot
        fit."""
        if by_heads and config.get("codebook") == "online":
            return "its online codebooks are fitted on the angles of all the layer's KV heads"
        return ""

    def make_codecs(self, cfg: PolarQuantConfig, kb: int, vb: int) -> tuple[Codec, Codec]:
        common = config_fields(cfg, "upper_bits", "levels", "rotation", "codebook", "seed")
        return PolarQuant(kb, **common), PolarQuant(vb, **common)
