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

from velox_core.cache.eviction import EvictionCache

from .config import QFiltersConfig
from .policy import QFiltersPolicy

__all__ = ["QFiltersCache"]


class QFiltersCache(EvictionCache):
    """Q-Filters' cache for one layer. Parameters: see :class:`QFiltersConfig`."""

    method = "qfilters"
    Config = QFiltersConfig
    Policy = QFiltersPolicy
    policy_params = ("budget", "every", "filters", "layer")

    fitted_on_whole_model = True  # its artifact: a split model is refused
