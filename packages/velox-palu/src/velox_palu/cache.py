"""``PaluCache``: Palu's key and value latents (arXiv 2407.21118), as a velox preset.

Keys are coded by :class:`~velox_palu.codec.PaluKeys` (pre-RoPE, projected onto the model's
fitted head-group basis, rebuilt and rotated per tile inside attention), values by
:class:`~velox_palu.codec.PaluValues` (projected likewise; attention mixes the latent and
applies the basis to the mix). Both latents are fp16, or quantized after a Hadamard rotation
with ``bits``. The bases are found when ``velox_core.make_cache`` binds the cache to its
model and layer.
"""

from __future__ import annotations

from velox_core import Codec, PresetCache, config_fields
from velox_core.codec.prerope import rope_settings

from .codec import PaluKeys, PaluValues
from .config import PaluConfig

__all__ = ["PaluCache"]


class PaluCache(PresetCache):
    """Palu's cache for one layer. Parameters: see :class:`PaluConfig`."""

    method = "palu"
    Config = PaluConfig

    fitted_on_whole_model = True  # its artifact: a split model is refused

    def make_codecs(self, cfg: PaluConfig, kb: int | None, vb: int | None) -> tuple[Codec, Codec]:
        common = config_fields(cfg, "ratio", "allocation", "artifact", "layer")
        keys = PaluKeys(
            cfg.key_rank,
            bits=kb,
            group=cfg.group if kb is not None else None,
            **rope_settings(cfg),
            **common,
        )
        values = PaluValues(
            cfg.value_rank,
            bits=vb,
            group=cfg.group if vb is not None else None,
            **common,
        )
        return keys, values
