"""``MorphKVCache``: MorphKV's eviction (arXiv 2503.00979) as a velox cache preset.

The cache is a :class:`velox_core.VeloxCache` with a :class:`~velox_morphkv.MorphKVPolicy`:
after each prefill chunk, and during decode at every step (``every=1``) once over ``budget``,
the stored tokens are cut to ``budget`` per KV head, keeping the newest ``observe`` tokens
and the older tokens their queries attend to most (fused by ``"sum"`` or ``"max"``).
Attention must be routed to the cache (``velox_core.routed(model)`` or
``velox_core.generate``) for the policy to see the queries; see :mod:`velox_morphkv.policy`
for the deviations from the paper. The paper keeps fp16 tokens; ``bits`` codes the kept
tokens with ``Uniform``.
"""

from __future__ import annotations

from velox_core.cache.eviction import EvictionCache

from .config import MorphKVConfig
from .policy import MorphKVPolicy

__all__ = ["MorphKVCache"]


class MorphKVCache(EvictionCache):
    """MorphKV's cache for one layer. Parameters: see :class:`MorphKVConfig`."""

    method = "morphkv"
    Config = MorphKVConfig
    Policy = MorphKVPolicy
    policy_params = ("budget", "every", "observe", "fusion", "keep_weights")
