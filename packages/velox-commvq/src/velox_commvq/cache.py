"""``CommVQCache``: CommVQ keys (arXiv 2506.18879) with ``Uniform`` values, as a velox preset.

Keys are coded by :class:`~velox_commvq.codec.CommVQKeys` (pre-RoPE, normalized, residual
commutative VQ with the model's fitted codebooks) and attended from their codes; values by
``velox_core.Uniform`` per-token codes (``value_bits``, ``group``), read directly by
``mx.quantized_matmul``. The paper learns a value encoder too; any velox codec composes
instead, e.g. CommVQ keys over TurboQuant values::

    VeloxCache(key_codec=CommVQKeys(bits=2), value_codec=TurboQuant(bits=3))

Codebooks are found when ``velox_core.make_cache`` binds the cache to its model and layer.
"""

from __future__ import annotations

from velox_core import Codec, PresetCache, Uniform
from velox_core.codec.prerope import rope_settings

from .codec import CommVQKeys
from .config import CommVQConfig

__all__ = ["CommVQCache"]


class CommVQCache(PresetCache):
    """CommVQ's cache for one layer. Parameters: see :class:`CommVQConfig`."""

    method = "commvq"
    Config = CommVQConfig

    fitted_on_whole_model = True  # its artifact: a split model is refused

    def make_codecs(self, cfg: CommVQConfig, kb: int, vb: int) -> tuple[Codec, Codec]:
        keys = CommVQKeys(kb, codebooks=cfg.codebooks, layer=cfg.layer, **rope_settings(cfg))
        return keys, Uniform(vb, cfg.group)
