"""velox-morphkv: MorphKV, a constant-size cache of the recent window and the older tokens it
attends to most, re-selected at every decode step (arXiv 2503.00979)."""

from velox_core.cache.eviction import eviction_method

from .cache import MorphKVCache
from .config import MorphKVConfig
from .policy import MorphKVPolicy

__all__ = ["METHOD", "MorphKVCache", "MorphKVConfig", "MorphKVPolicy"]

METHOD = eviction_method(
    MorphKVCache,
    summary="recent window plus the older tokens its queries attend to most (sum or max), "
    "per KV head; re-selected every decode step",
    paper="https://arxiv.org/abs/2503.00979",
)
