"""``KVzipCache``: KVzip (arXiv 2505.23416) as a velox cache preset.

The cache is a :class:`velox_core.VeloxCache` with a :class:`~velox_kvzip.KVzipPolicy`: it
keeps every token as the prefill stores it, until :func:`velox_kvzip.compress` scores the
context by reconstruction and cuts each layer to its budget (``heads`` says how the budget is
shared among the heads and layers); every later token is kept. The paper keeps fp16 tokens;
``bits`` codes the kept tokens with ``Uniform``.
"""

from __future__ import annotations

from velox_core.cache.eviction import EvictionCache

from .config import KVzipConfig
from .policy import KVzipPolicy

__all__ = ["KVzipCache"]


class KVzipCache(EvictionCache):
    """KVzip's cache for one layer. Parameters: see :class:`KVzipConfig`."""

    method = "kvzip"
    Config = KVzipConfig
    Policy = KVzipPolicy

    policy_params = ("budget", "every", *KVzipPolicy.settings)

    @classmethod
    def split_refusal(cls, config: dict, by_heads: bool, pipelined: bool) -> str:
        """A split by heads holds its share only with ``heads="uniform"`` (each KV head keeps
        its own best pairs); pipeline stages only without ``heads="global"`` (one ranking of
        every layer's pairs). Where accepted, :func:`velox_kvzip.compress` must run on every
        process (its forward is the model's)."""
        heads = config.get("heads", "global")
        if by_heads and heads != "uniform":
            return (
                f"with heads={heads!r} its budget is shared among the KV heads of "
                f"{'every layer' if heads == 'global' else 'a layer'} (use heads='uniform' on a "
                "sharded model)"
            )
        if pipelined and heads == "global":
            return (
                "with heads='global' one ranking covers every layer's pairs, across the "
                "stages (use heads='layer' or 'uniform')"
            )
        return ""
