"""``NestedKVCache``: key-only eviction by multi-time-scale cosine anomaly (arXiv 2605.26678).

A preset of :class:`velox_core.VeloxCache`: fp16 attention sinks, an optional fp16 window,
a body of kept tokens (fp16, or ``Uniform`` codes when ``bits`` is set) and
:class:`~velox_nestedkv.NestedKVPolicy`, which scores body tokens from their keys alone and
evicts down to ``budget`` after every prompt chunk (and, with ``every``, during decode).

With ``heads="adaptive"`` (the paper's per-head budgets) heads keep different numbers of
tokens; velox then stores one record per KV head, which only velox attention reads: run the
model inside ``velox_core.routed(model)`` or ``velox_core.generate`` (batch 1). Batches of
more than one sequence fall back to ``budget`` tokens per head.
"""

from __future__ import annotations

from velox_core.cache.eviction import EvictionCache

from .config import NestedKVConfig
from .policy import NestedKVPolicy

__all__ = ["NestedKVCache"]


class NestedKVCache(EvictionCache):
    """NestedKV's cache for one layer. Parameters: see :class:`NestedKVConfig`."""

    method = "nestedkv"
    Config = NestedKVConfig
    Policy = NestedKVPolicy
    policy_params = (
        "budget",
        "every",
        "recent",
        "block",
        "beta",
        "tau",
        "kappa",
        "prior",
        "safeguard",
        "heads",
    )

    @classmethod
    def split_refusal(cls, config: dict, by_heads: bool, pipelined: bool) -> str:
        """Why a model split over processes cannot use this cache ("": it can); see
        :mod:`velox_core.distributed`."""
        if not by_heads or config.get("heads", "adaptive") != "adaptive":
            return ""
        return (
            "with heads='adaptive' its budget is shared among all the layer's KV heads (use "
            "heads='uniform' on a sharded model)"
        )
