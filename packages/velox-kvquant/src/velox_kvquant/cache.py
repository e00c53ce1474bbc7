"""``KVQuantCache``: KVQuant's key and value codecs, an fp16 attention sink, calibration.

The paper calibrates the per-channel key scales, the outlier thresholds and the nuq datatypes
offline on a calibration set. Here the cache calibrates on the sequence itself: the first
``calibration`` tokens after the sinks stay in fp16 until they are all there, then the key
codec fits its per-channel scales and both codecs fit their datatypes on them (per layer,
per sequence of the batch), codes them, and codes every later token with the same fit.
"""

from __future__ import annotations

from typing import Any

from velox_core import PresetCache, resolve_bits

from .config import KVQuantConfig
from .keys import KVQuantKeys
from .values import KVQuantValues

__all__ = ["KVQuantCache"]


class KVQuantCache(PresetCache):
    """KVQuant's cache for one layer. Parameters: see :class:`KVQuantConfig`."""

    method = "kvquant"
    # calibration decides in the window when coding starts: tokens leave it one at a time
    default_flush = 1
    Config = KVQuantConfig

    def build(self, cfg: KVQuantConfig) -> dict[str, Any]:
        kb, vb = resolve_bits(cfg.bits, cfg.key_bits, cfg.value_bits)
        shared = {"outliers": cfg.outliers, "datatype": cfg.datatype, "qnorm": cfg.qnorm}
        keys = KVQuantKeys(
            kb,
            **shared,
            pre_rope=cfg.pre_rope,
            rope_base=cfg.rope_base,
            rope_traditional=cfg.rope_traditional,
            rope_scale=cfg.rope_scale,
            rope_dims=cfg.rope_dims,
        )
        return {
            "key_codec": keys,
            "value_codec": KVQuantValues(vb, **shared),
            "window": cfg.window,
            "sinks": cfg.sinks,
        }

    @property
    def calibrated(self) -> bool:
        """Whether the codecs have fitted their scales and datatypes."""
        t = self.tiers[0]
        return t.key_codec.fitted and t.value_codec.fitted

    def before_coding(self) -> bool:
        """Until calibrated, the window also holds the calibration tokens: nothing is coded
        before ``window + calibration`` tokens are stored (the codecs fit on encode)."""
        return self.calibrated or self._win[0].tokens >= self.window + self.cfg.calibration

    # -- batching: the codecs' fitted arrays have one row per sequence (velox-core's filter and
    # extend slice and join them through the codecs' filter_batch / extend_batch)
    def extend(self, other: KVQuantCache) -> None:
        if type(other) is type(self) and self.calibrated != other.calibrated:
            raise ValueError(
                "extend: both caches must be calibrated, or neither (feed each past its "
                f"{self.cfg.calibration} calibration tokens)"
            )
        super().extend(other)
