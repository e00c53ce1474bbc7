"""``SnapKVCache``: SnapKV's eviction (optionally with ``Uniform`` codes for the kept tokens).

The cache is a :class:`velox_core.VeloxCache` with a :class:`~velox_snapkv.SnapKVPolicy`:
after each prefill chunk (and, with ``every``, during decode) the stored tokens are cut to
``budget`` per KV head, keeping what the observation window votes for. Attention must be
routed to the cache (``velox_core.routed(model)`` or ``velox_core.generate``) for the policy
to see the queries; see :mod:`velox_snapkv.policy` for the mechanism and the deviations from
the paper. The paper keeps fp16 tokens; ``bits`` codes the kept tokens with ``Uniform``.
"""

from __future__ import annotations

from velox_core.cache.eviction import EvictionCache
from velox_core.policy.voting import VOTE_PARAMS

from .config import SnapKVConfig
from .policy import SnapKVPolicy

__all__ = ["SnapKVCache"]


class SnapKVCache(EvictionCache):
    """SnapKV's cache for one layer. Parameters: see :class:`SnapKVConfig`."""

    method = "snapkv"
    Config = SnapKVConfig
    Policy = SnapKVPolicy
    policy_params = VOTE_PARAMS
