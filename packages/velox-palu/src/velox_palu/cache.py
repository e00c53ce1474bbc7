"""``PaluCache``: Palu's key and value latents (arXiv 2407.21118), as a velox preset.

Keys are coded by :class:`~velox_palu.codec.PaluKeys` (pre-RoPE, projected onto the model's
fitted head-group basis, rebuilt and rotated per tile inside attention), values by
:class:`~velox_palu.codec.PaluValues` (projected likewise; attention mixes the latent and
applies the basis to the mix). Both latents are fp16, or quantized after a Hadamard rotation
with ``bits``. The bases are found when ``velox_core.make_cache`` binds the cache to its
model and layer.
"""

from __future__ import annotations

from typing import Any

from velox_core import PresetCache
from velox_core.codec.prerope import rope_settings

from .codec import PaluKeys, PaluValues
from .config import PaluConfig

__all__ = ["PaluCache"]


class PaluCache(PresetCache):
    """Palu's cache for one layer. Parameters: see :class:`PaluConfig`."""

    method = "palu"
    Config = PaluConfig

    def build(self, cfg: PaluConfig) -> dict[str, Any]:
        kb = cfg.bits if cfg.key_bits is None else cfg.key_bits
        vb = cfg.bits if cfg.value_bits is None else cfg.value_bits
        common = {"ratio": cfg.ratio, "allocation": cfg.allocation, "artifact": cfg.artifact}
        keys = PaluKeys(
            cfg.key_rank,
            bits=kb,
            group=cfg.group if kb is not None else None,
            layer=cfg.layer,
            **rope_settings(cfg),
            **common,
        )
        values = PaluValues(
            cfg.value_rank,
            bits=vb,
            group=cfg.group if vb is not None else None,
            layer=cfg.layer,
            **common,
        )
        return {"key_codec": keys, "value_codec": values}
