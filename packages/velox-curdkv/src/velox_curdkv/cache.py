"""``CurDKVCache``: CurDKV eviction (arXiv 2509.15038) as a velox cache preset.

The cache is a :class:`velox_core.VeloxCache` with a :class:`~velox_curdkv.CurDKVPolicy`:
after each prefill chunk (and, with ``every``, during decode) the stored tokens are cut to
``budget`` per KV head, keeping the ``sinks`` first tokens, the ``window`` most recent ones
and, between them, the tokens of highest key-times-value leverage score. Query-free: it
needs no routed attention. The paper keeps fp16 tokens; ``bits`` codes the kept tokens with
``Uniform``.

The same policy composes with any per-token codec::

    VeloxCache(key_codec=Uniform(4), value_codec=Uniform(4), policy=CurDKVPolicy(budget=1024))
"""

from __future__ import annotations

from velox_core.cache.eviction import EvictionCache

from .config import CurDKVConfig
from .policy import CurDKVPolicy

__all__ = ["CurDKVCache"]


class CurDKVCache(EvictionCache):
    """CurDKV's cache for one layer. Parameters: see :class:`CurDKVConfig`."""

    method = "curdkv"
    Config = CurDKVConfig
    Policy = CurDKVPolicy
    policy_params = ("budget", "every", "sketch", "local", "seed")
