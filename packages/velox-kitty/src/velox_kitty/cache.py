"""``KittyCache``: Kitty's boosted per-channel keys, per-token values, fp16 sinks and window.

Kitty (arXiv 2511.18643) quantizes keys per channel in pages of ``group`` tokens at ``bits``
(2), and in each page and KV head boosts the ``int(D * boost)`` channels of largest magnitude
(or variance, ``score="variance"``) over that page's tokens to ``boost_bits`` (4): the
channels' widths follow statistics gathered online, page by page, as the tokens arrive.
Values are quantized per token (``value_group`` channels a group) at ``bits``. The first
``sinks`` tokens and the newest ``window`` stay in fp16.

Deviation from the paper: Kitty's keys leave fp16 a page at a time as soon as a page is
whole (0 to 127 fp16 keys), while its values keep a 128-token local buffer (128 to 255 fp16
values). Here keys and values leave the window together, a page at a time, so between
``window`` and ``window + group - 1`` of the newest tokens are fp16 for both: ``window=128``
(the default) is the paper's value side, ``window=0`` its key side.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from velox_core import Codec, PresetCache, Uniform, config_fields

from .codec import KittyKeys
from .config import KittyConfig

__all__ = ["KittyCache"]


class KittyCache(PresetCache):
    """Kitty's cache for one layer. Parameters: see :class:`KittyConfig`.

    Each KV head ranks its own channels, so a model split by heads holds exactly its heads'
    share (``split_refusal`` gives no reason, ``mixes_heads`` is empty).
    """

    method = "kitty"
    Config = KittyConfig

    def make_codecs(self, cfg: KittyConfig, kb: int, vb: int) -> tuple[Codec, Codec]:
        keys = KittyKeys(kb, **config_fields(cfg, "boost_bits", "boost", "group", "score"))
        # value_group=None (a whole head) is set once the head dim is known (check_dims);
        # until then a 1-channel group stands in, never used to code
        return keys, Uniform(vb, cfg.value_group or 1, axis="token")

    def check_dims(self, key_dim: int, value_dim: int, dtype: Any = None) -> None:
        """``value_group=None`` becomes the value head dim (the paper's whole-head groups)
        before the codecs are asked; the config then names it, so a saved cache reloads with
        the same groups."""
        if self.cfg.value_group is None:
            self.cfg = dataclasses.replace(self.cfg, value_group=value_dim)
            vb = self.tiers[0].value_codec.bits
            self.tiers[0].value_codec = Uniform(vb, value_dim, axis="token")
        super().check_dims(key_dim, value_dim, dtype)
