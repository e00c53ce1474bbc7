"""``KNormCache``: KNorm eviction (arXiv 2406.11430) as a velox cache preset.

The cache is a :class:`velox_core.VeloxCache` with a :class:`~velox_knorm.KNormPolicy`:
after each prefill chunk (and, with ``every``, during decode) the stored tokens are cut to
``budget`` per KV head, keeping the ``sinks`` first tokens, the ``window`` most recent ones
and, between them, the tokens of lowest key norm. Query-free: it needs no routed attention.
The paper keeps fp16 tokens; ``bits`` codes the kept tokens with ``Uniform``.

The same policy composes with any per-token codec::

    VeloxCache(key_codec=Uniform(4), value_codec=Uniform(4), policy=KNormPolicy(budget=1024))
"""

from __future__ import annotations

from velox_core.cache.eviction import EvictionCache

from .config import KNormConfig
from .policy import KNormPolicy

__all__ = ["KNormCache"]


class KNormCache(EvictionCache):
    """KNorm's cache for one layer. Parameters: see :class:`KNormConfig`."""

    method = "knorm"
    Config = KNormConfig
    Policy = KNormPolicy
