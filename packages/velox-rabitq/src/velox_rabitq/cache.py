"""``RaBitQCache``: RaBitQ-coded keys, per-token quantized values.

Keys go through :class:`~velox_rabitq.codec.RaBitQ` (rotation, sign or extended code, norm
and ``<o_bar, o>`` per token, a centroid per block of ``centroid`` tokens), and attention
scores come from the papers' unbiased estimator. Values go through ``velox_core.Uniform``
per token (``value_bits``, ``group`` channels per group). Keys are post-RoPE, as mlx-lm stores
them: RaBitQ codes any vector, so no position handling is needed.

Deviations from the papers (arXiv 2405.12497, 2409.09913; docs/rabitq.md lists them all):
the rotation is a randomized (block-)Hadamard transform instead of a Haar matrix; the
centroid is the mean of each block of ``centroid`` tokens (per batch row and head) instead of
an IVF cluster's centroid; the query is kept in float32 instead of being quantized to 4 bits
(Section 3.3.1 quantizes it only to use bitwise kernels); the factors are fp16 (bf16 for bf16
models); the extended code is searched over every critical value of the rescale factor.
"""

from __future__ import annotations

from velox_core import Codec, PresetCache, Uniform

from .codec import RaBitQ
from .config import RaBitQConfig

__all__ = ["RaBitQCache"]


class RaBitQCache(PresetCache):
    """RaBitQ's cache for one layer. Parameters: see :class:`RaBitQConfig`."""

    method = "rabitq"
    Config = RaBitQConfig

    def make_codecs(self, cfg: RaBitQConfig, kb: int, vb: int) -> tuple[Codec, Codec]:
        return RaBitQ(kb, cfg.centroid, cfg.rounds, cfg.seed), Uniform(vb, cfg.group, axis="token")
