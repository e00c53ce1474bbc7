"""``SVDqCache``: SVDq's key codec, values through a velox codec, and the basis fit.

The paper fits the SVD basis on the prefill's keys. A cache sees a prefill in chunks and
cannot know where it ends, so the first ``calibration`` tokens after the sinks wait in fp16
(in the window) until they are all there; the key codec then fits its basis (per layer, KV
head and sequence of the batch) on every whole block the window holds, codes them, and codes
every later token (the rest of the prefill and the decode tokens) by projecting it onto that
basis, ``group`` tokens at a time. A prefill that arrives in one piece of at least
``calibration`` tokens is fitted on all of it, as in the paper. Values are coded per token by
``velox_core.Uniform`` (``value_bits``), or kept in fp16 (``value_bits=16``); any other
velox value codec composes with :class:`~velox_svdq.codec.SVDqKeys` through
``velox_core.VeloxCache(key_codec=..., value_codec=...)``.
"""

from __future__ import annotations

from typing import Any

from velox_core import Identity, Uniform
from velox_core.cache.preset import CalibratedPreset
from velox_core.codec.prerope import rope_settings

from .codec import SVDqKeys
from .config import FP16_VALUES, SVDqConfig

__all__ = ["SVDqCache"]


class SVDqCache(CalibratedPreset):
    """SVDq's cache for one layer. Parameters: see :class:`~velox_svdq.config.SVDqConfig`."""

    method = "svdq"
    Config = SVDqConfig

    def build(self, cfg: SVDqConfig) -> dict[str, Any]:
        keys = SVDqKeys(
            cfg.schedule,
            rank=cfg.rank,
            group=cfg.group,
            center=cfg.center,
            **rope_settings(cfg),
        )
        if cfg.value_bits == FP16_VALUES:
            values = Identity()
        else:
            values = Uniform(cfg.value_bits, cfg.group, axis="token")
        return {"key_codec": keys, "value_codec": values}

    @property
    def fitted(self) -> bool:
        """Whether the key codec has fitted its basis (:attr:`calibrated`)."""
        return self.calibrated
