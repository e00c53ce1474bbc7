"""``AdaKVCache``: Ada-KV's head-wise adaptive budgets (arXiv 2407.11550) as a velox preset.

Ada-KV observes that attention heads differ in how concentrated their attention is: a few
tokens carry almost all of some heads' attention, while others spread it over many. A
uniform per-head budget wastes tokens on the first kind and starves the second. Ada-KV keeps
a layer's total budget but lets the heads compete for it: the highest scores across all
heads win (a joint top-k), with a safeguard floor per head. The scores come from a base
eviction method: SnapKV's observation-window vote here (or Q-Filters, if installed).

The body (between the ``sinks`` and the ``window``, which are always kept) is stored one
record per KV head after the first eviction, so heads hold different numbers of tokens
without padding; attention runs head by head (routed attention only; batch size 1). Kept
tokens may be coded with ``Uniform`` (``bits``), which the paper does not do.

Deviations from the paper are listed in ``docs/adakv.md`` (and in the scorer and policy
modules): velox evicts after every prefill chunk and optionally during decode, scores with
the queries it observed last, and keeps absolute positions (no re-positioning).
"""

from __future__ import annotations

from velox_core.cache.eviction import EvictionCache

from .config import AdaKVConfig
from .policy import AdaKVPolicy

__all__ = ["AdaKVCache"]


class AdaKVCache(EvictionCache):
    """Ada-KV's cache for one layer. Parameters: see :class:`AdaKVConfig`."""

    method = "adakv"
    Config = AdaKVConfig
    Policy = AdaKVPolicy
    policy_params = ("budget", "every", "alpha", "observe", "kernel", "pooling", "base")

    # why a model split by heads cannot use it (VeloxCache.split_refusal)
    mixes_heads = (
        "its budget is shared among all the layer's KV heads (head-wise allocation): a "
        "process seeing some heads would allocate among those only"
    )
