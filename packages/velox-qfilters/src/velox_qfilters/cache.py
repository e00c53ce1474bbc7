"""``QFiltersCache``: Q-Filters eviction (arXiv 2503.02812) as a velox cache preset.

Each KV head keeps, besides the ``sinks`` first tokens and the ``window`` most recent ones,
the body tokens whose keys project most on the head's Q-Filter (the oriented principal
direction of its post-RoPE queries, fitted once per model): see
:class:`~velox_qfilters.policy.QFiltersPolicy`. Kept tokens may be coded with ``Uniform``
(``bits``), which the paper does not do. Filters are found when ``velox_core.make_cache``
binds the cache to its model and layer.

The same policy composes with any per-token codec, e.g. Q-Filters over TurboQuant storage::

    VeloxCache(key_codec=TurboQuant(bits=3), value_codec=TurboQuant(bits=3),
               policy=QFiltersPolicy(budget=1024), window=64)
"""

from __future__ import annotations

from typing import Any

from velox_core import PresetCache, kept_codecs

from .config import QFiltersConfig
from .policy import QFiltersPolicy

__all__ = ["QFiltersCache"]


class QFiltersCache(PresetCache):
    """Q-Filters' cache for one layer. Parameters: see :class:`QFiltersConfig`."""

    method = "qfilters"
    Config = QFiltersConfig

    def build(self, cfg: QFiltersConfig) -> dict[str, Any]:
        codecs = kept_codecs(cfg)
        policy = QFiltersPolicy(cfg.budget, cfg.every, cfg.filters, cfg.layer)
        return {**codecs, "sinks": cfg.sinks, "window": cfg.window, "policy": policy}
