"""``TurboQuantCache``: TurboQuant codes for keys (mse or prod) and values (mse).

Every key and value vector is rotated by a seeded randomized Hadamard transform, its norm is
kept in fp16 and each coordinate of the normalized rotated vector is replaced by its Lloyd-Max
code for the law of a coordinate of a uniform unit vector (TurboQuant, arXiv 2504.19874).
Keys may use the inner-product variant (one of the bits becomes a QJL sign sketch of the
residual, making ``q . k`` unbiased); values always use the MSE variant, since the paper's
inner-product variant targets inner products, not reconstructions. Fractional widths
(2.5, 3.5, ...) give a share of outlier channels one bit more. Deviations from the paper are
listed in :mod:`velox_turboquant.codec` and docs/turboquant.md.
"""

from __future__ import annotations

from velox_core import Codec, PresetCache

from .codec import TurboQuant
from .config import TurboQuantConfig

__all__ = ["TurboQuantCache"]


class TurboQuantCache(PresetCache):
    """TurboQuant's cache for one layer. Parameters: see :class:`TurboQuantConfig`."""

    method = "turboquant"
    Config = TurboQuantConfig

    def make_codecs(
        self, cfg: TurboQuantConfig, kb: int | float, vb: int | float
    ) -> tuple[Codec, Codec]:
        def group(bits):  # tokens sharing the outlier channels: fractional widths only
            return cfg.group if isinstance(bits, float) else None

        keys = TurboQuant(kb, cfg.key_variant, group(kb), cfg.seed)
        return keys, TurboQuant(vb, "mse", group(vb), cfg.seed)
