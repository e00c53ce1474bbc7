"""``KIVICache``: per-channel keys, per-token values, an fp16 residual window.

KIVI observes that key caches have outlier *channels* (a few channels are large for every
token) while value caches have no such structure; so keys are quantized per channel (a group
is ``group`` consecutive tokens of one channel) and values per token (a group is ``group``
consecutive channels of one token), asymmetric (scale and zero) at 2 or 4 bits. The newest
tokens stay in fp16 in a residual window and are quantized as it fills.

Deviation from the paper: KIVI's reference code keeps between 0 and ``R`` key tokens in fp16
(it quantizes the residual all at once when it reaches ``R``) while it streams values out of
an ``R``-token window. Here keys and values leave the window together, ``flush`` tokens
(velox's default 64, whole key groups) at a time, so between ``window`` and
``window + flush - 1`` of the newest tokens are fp16 for both (``window=0, flush=R`` is the
reference code's key residual). Attention reads the codes directly: per-token value codes through
``mx.quantized_matmul``, per-channel key codes with the scales folded into the query.
"""

from __future__ import annotations

from velox_core import Codec, PresetCache, Uniform

from .config import KIVIConfig

__all__ = ["KIVICache"]


class KIVICache(PresetCache):
    """KIVI's cache for one layer. Parameters: see :class:`KIVIConfig`."""

    method = "kivi"
    Config = KIVIConfig

    def make_codecs(self, cfg: KIVIConfig, kb: int, vb: int) -> tuple[Codec, Codec]:
        return Uniform(kb, cfg.group, axis="channel"), Uniform(vb, cfg.group, axis="token")
