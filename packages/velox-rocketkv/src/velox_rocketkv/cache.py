"""``RocketKVCache``: RocketKV's two stages (optionally with ``Uniform`` codes of the kept
tokens).

The cache is a :class:`velox_core.VeloxCache` with a :class:`~velox_rocketkv.RocketKVPolicy`:
after each prefill chunk (or once at the prompt's end, ``prefill="prompt"``; and with
``every``, during decode) SnapKV++ cuts the stored tokens back to the budget per KV head, and
each decode step attends only the ``topk`` kept tokens per KV head that the hybrid sparse
scores pick. Attention must be routed to the cache (``velox_core.routed(model)`` or
``velox_core.generate``): the observation window's queries vote only there, and a decode step
attends sparsely only there (unrouted, mlx-lm attends every stored token itself). See
:mod:`velox_rocketkv.policy` for the mechanism and the budget.
"""

from __future__ import annotations

from velox_core.cache.eviction import EvictionCache
from velox_core.policy.voting import VOTE_PARAMS

from .config import RocketKVConfig
from .policy import RocketKVPolicy

__all__ = ["RocketKVCache"]


class RocketKVCache(EvictionCache):
    """RocketKV's cache for one layer. Parameters: see :class:`RocketKVConfig`."""

    method = "rocketkv"
    Config = RocketKVConfig
    Policy = RocketKVPolicy
    policy_params = (*VOTE_PARAMS, "ratio", "topk", "page", "channels")

    def trim(self, n: int) -> int:
        """Remove the last ``n`` tokens (not exact: eviction); the page summaries are made
        again at the next decode step."""
        out = super().trim(n)
        if self.policy.pages is not None:
            self.policy.pages.invalidate()
        return out
