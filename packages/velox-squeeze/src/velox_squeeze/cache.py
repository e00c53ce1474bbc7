"""``SqueezeCache``: SqueezeAttention's layer budgets (optionally with ``Uniform`` codes).

The cache is a :class:`velox_core.VeloxCache` with a :class:`~velox_squeeze.SqueezePolicy`:
after each prefill chunk (and, with ``every``, during decode) the layer's stored tokens are
cut to *its* budget per KV head, which depends on how much its attention changes the hidden
states (:mod:`velox_squeeze.allocate`), measured on the prompt by the observer that
``velox_core.make_cache(model, ...)`` installs (:mod:`velox_squeeze.observe`). The base
policy (``base``) chooses the tokens: SnapKV's votes need routed attention
(``velox_core.routed(model)`` or ``velox_core.generate``).
"""

from __future__ import annotations

from velox_core.cache.eviction import EvictionCache

from .config import SqueezeConfig
from .policy import SqueezePolicy

__all__ = ["SqueezeCache"]


class SqueezeCache(EvictionCache):
    """SqueezeAttention's cache for one layer. Parameters: see :class:`SqueezeConfig`."""

    method = "squeeze"
    Config = SqueezeConfig
    Policy = SqueezePolicy
    policy_params = ("budget", "every", "p", "base", "observe", "kernel", "pooling")

    # each KV head keeps its own tokens (SnapKV's votes per KV head, or the recent ones), and
    # the cosine is of the whole hidden state, which every process of a split by heads holds
    @classmethod
    def split_refusal(cls, config: dict, by_heads: bool, pipelined: bool) -> str:
        if pipelined:
            return (
                "its layer budgets are decided together from every layer's importance, and a "
                "pipeline stage holds only some of the layers"
            )
        return ""
