"""``KVQuantCache``: KVQuant's key and value codecs, an fp16 attention sink, calibration.

The paper calibrates the per-channel key scales, the outlier thresholds and the nuq datatypes
offline on a calibration set. Here the cache calibrates on the sequence itself: the first
``calibration`` tokens after the sinks stay in fp16 until they are all there, then the key
codec fits its per-channel scales and both codecs fit their datatypes on them (per layer,
per sequence of the batch), codes them, and codes every later token with the same fit.
"""

from __future__ import annotations

from velox_core import Codec, config_fields
from velox_core.cache.preset import CalibratedPreset
from velox_core.codec.prerope import rope_settings

from .config import KVQuantConfig
from .keys import KVQuantKeys
from .values import KVQuantValues

__all__ = ["KVQuantCache"]


class KVQuantCache(CalibratedPreset):
    """KVQuant's cache for one layer. Parameters: see :class:`KVQuantConfig`."""

    method = "kvquant"
    # calibration decides in the window when coding starts: tokens leave it one at a time
    default_flush = 1
    Config = KVQuantConfig

    # why a model split by heads cannot use it (VeloxCache.split_refusal)
    mixes_heads = (
        "its non-uniform datatype (the levels of its codes) is fitted over all the layer's "
        "heads together"
    )

    def make_codecs(self, cfg: KVQuantConfig, kb: int, vb: int) -> tuple[Codec, Codec]:
        shared = config_fields(cfg, "outliers", "datatype", "qnorm")
        return KVQuantKeys(kb, **shared, **rope_settings(cfg)), KVQuantValues(vb, **shared)
