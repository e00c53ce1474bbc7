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

from typing import Any

from velox_core import PresetCache, kept_codecs

from .config import NestedKVConfig
from .policy import NestedKVPolicy

__all__ = ["NestedKVCache"]


class NestedKVCache(PresetCache):
    """NestedKV's cache for one layer. Parameters: see :class:`NestedKVConfig`."""

    method = "nestedkv"
    Config = NestedKVConfig

    def build(self, cfg: NestedKVConfig) -> dict[str, Any]:
        codecs = kept_codecs(cfg)
        policy = NestedKVPolicy(
            budget=cfg.budget,
            every=cfg.every,
            recent=cfg.recent,
            block=cfg.block,
            beta=cfg.beta,
            tau=cfg.tau,
            kappa=cfg.kappa,
            prior=cfg.prior,
            safeguard=cfg.safeguard,
            heads=cfg.heads,
        )
        return {**codecs, "sinks": cfg.sinks, "window": cfg.window, "policy": policy}
