"""``SpectralCache``: keys and values coded in calibrated per-head PCA bases, the leading
components by a finer Lloyd-Max codebook than the rest, with exact sinks and a recent window,
as a velox preset.

The cache keeps three segments: the first ``sinks`` tokens exact, the body coded by
:class:`~velox_spectral.codec.SpectralKeys` and :class:`~velox_spectral.codec.SpectralValues`,
and the newest ``window`` tokens exact; attention over the three is one softmax (velox-core's
log-sum-exp merge). The bases are found when ``velox_core.make_cache`` binds the cache to its
model and layer.
"""

from __future__ import annotations

from velox_core import Codec, PresetCache, config_fields

from .codec import SpectralKeys, SpectralValues
from .config import SpectralConfig

__all__ = ["SpectralCache"]


class SpectralCache(PresetCache):
    """The spectral quantizer's cache for one layer. Parameters: see :class:`SpectralConfig`."""

    method = "spectral"
    Config = SpectralConfig

    fitted_on_whole_model = True  # its artifact: a split model is refused

    def build(self, cfg: SpectralConfig) -> dict:
        common = config_fields(
            cfg, "signal_bits", "noise_bits", "rank", "variance", "artifact", "layer"
        )
        keys: Codec = SpectralKeys(**common)
        return {"key_codec": keys, "value_codec": SpectralValues(**common)}
