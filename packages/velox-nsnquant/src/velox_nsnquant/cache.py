"""``NSNQuantCache``: NSNQuant's codes of keys and values, fp16 sinks and the block being filled.

NSNQuant (arXiv 2505.18231) normalizes each token, centres a block of ``group`` tokens on
their mean, normalizes again and rotates the result by a Hadamard transform, so that every
token of every model looks like a standard normal vector; one codebook fitted once on
synthetic Gaussian vectors then codes all of them (calibration-free: nothing is fitted on the
model). See :mod:`velox_nsnquant.codec` for the codes and how attention reads them.

Deviations from the paper (also in docs/nsnquant.md; its method section could not be read
here, so the details below are velox's choices where the abstract is silent): the shift is
the mean of each block of ``group`` tokens; the codebooks are k-means books of sub-vectors
(8, 4, 2, 2 channels at 1 to 4 bits) fitted on synthetic Gaussian samples, without the
fine-tuning of codewords a VQ method may add; each token keeps a least-squares gain folded
into its fp16 scale; keys are coded post-RoPE (mlx-lm hands the cache rotated keys); the
metadata (two scales a token, one shift a block) is fp16.
"""

from __future__ import annotations

from typing import Any

from velox_core import Codec, PresetCache, config_fields

from .codec import NSNQuantCodec
from .config import NSNQuantConfig

__all__ = ["NSNQuantCache"]


class NSNQuantCache(PresetCache):
    """NSNQuant's cache for one layer. Parameters: see :class:`NSNQuantConfig`.

    Each KV head is coded on its own (its own shifts and scales, the shared codebook), so a
    model split by heads holds exactly its heads' share.
    """

    method = "nsnquant"
    Config = NSNQuantConfig

    def __init__(self, flush: int | None = None, check_finite: bool = False, **params: Any):
        # a block of ``group`` tokens is coded at once: by default the window passes on one
        # block at a time (velox's default flush, 64, would be rounded up to the block)
        if flush is None:
            flush = params.get("group", NSNQuantConfig.group)
        super().__init__(flush=flush, check_finite=check_finite, **params)

    def make_codecs(self, cfg: NSNQuantConfig, kb: int, vb: int) -> tuple[Codec, Codec]:
        common = config_fields(cfg, "group", "seed")
        return NSNQuantCodec(kb, **common), NSNQuantCodec(vb, **common)
