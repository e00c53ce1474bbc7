"""``H2OCache``: H2O's eviction (arXiv 2306.14048) as a velox cache preset.

The cache is a :class:`velox_core.VeloxCache` with a :class:`~velox_h2o.H2OPolicy`: every
attention call adds its queries' softmax weights to each stored token's score; after each
prefill chunk, and during decode at every step (``every=1``) once over ``budget``, the stored
tokens are cut to ``budget`` per KV head, keeping the ``recent`` newest tokens and the heavy
hitters (the largest accumulated scores). Attention must be routed to the cache
(``velox_core.routed(model)`` or ``velox_core.generate``) for the policy to see the queries;
see :mod:`velox_h2o.policy` for the deviations from the paper. The paper keeps fp16 tokens;
``bits`` codes the kept tokens with ``Uniform``.
"""

from __future__ import annotations

from typing import Any

from velox_core.cache.eviction import EvictionCache

from .config import H2OConfig
from .policy import H2OPolicy

__all__ = ["H2OCache"]


class H2OCache(EvictionCache):
    """H2O's cache for one layer. Parameters: see :class:`H2OConfig`."""

    method = "h2o"
    Config = H2OConfig
    Policy = H2OPolicy

    # each KV head accumulates and keeps its own tokens (its query heads' mean), so a split
    # by heads holds exactly its share: mixes_heads stays ""

    def make_policy(self, cfg: H2OConfig) -> Any:
        return H2OPolicy(budget=cfg.budget, every=cfg.every, recent=cfg.recent_tokens)
