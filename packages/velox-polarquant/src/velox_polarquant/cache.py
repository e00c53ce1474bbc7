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
- The codebooks solve the paper's Eq. 4 exactly, by Lloyd's iteration on the angle laws,
  where the paper runs 1-D k-means++ on sampled angles (its "offline" codebook); its "online"
  codebook, fitted on each prompt, is not carried over.
- Codes are packed as one bit stream a level, in whole bytes (the paper: uint8 units).
- velox's ``flush``: with ``window=0`` up to ``flush - 1`` (63) of the newest tokens wait in
  fp16 until the next whole block of them is coded.
"""

from __future__ import annotations

from velox_core import Codec, PresetCache, config_fields

from .codec import PolarQuant
from .config import PolarQuantConfig

__all__ = ["PolarQuantCache"]


class PolarQuantCache(PresetCache):
    """PolarQuant's cache for one layer. Parameters: see :class:`PolarQuantConfig`.

    Each vector is coded on its own, so a model split by heads holds exactly its heads' share.
    """

    method = "polarquant"
    Config = PolarQuantConfig

    def make_codecs(self, cfg: PolarQuantConfig, kb: int, vb: int) -> tuple[Codec, Codec]:
        common = config_fields(cfg, "upper_bits", "levels", "rotation", "seed")
        return PolarQuant(kb, **common), PolarQuant(vb, **common)
