"""``TOVACache``: TOVA's eviction (arXiv 2401.06104) as a velox cache preset.

The cache is a :class:`velox_core.VeloxCache` with a :class:`~velox_tova.TOVAPolicy`: after
each prefill chunk, and during decode at every step (``every=1``) once over ``budget``, the
stored tokens are cut to ``budget`` per KV head, keeping those the last query attends to most
(its weights averaged over the layer's heads: every KV head keeps the same tokens). Attention
must be routed to the cache (``velox_core.routed(model)`` or ``velox_core.generate``) for the
policy to see the queries; see :mod:`velox_tova.policy` for the deviations from the paper.
The paper keeps fp16 tokens; ``bits`` codes the kept tokens with ``Uniform``.
"""

from __future__ import annotations

from velox_core.cache.eviction import EvictionCache

from .config import TOVAConfig
from .policy import TOVAPolicy

__all__ = ["TOVACache"]


class TOVACache(EvictionCache):
    """TOVA's cache for one layer. Parameters: see :class:`TOVAConfig`."""

    method = "tova"
    Config = TOVAConfig
    Policy = TOVAPolicy

    # why a model split by heads cannot use it (VeloxCache.split_refusal)
    mixes_heads = (
        "it scores tokens by attention averaged over all the layer's heads and keeps the "
        "same tokens in every head"
    )
