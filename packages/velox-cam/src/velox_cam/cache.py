"""``CamCache``: CaM's cache (ICML 2024) as a velox cache preset.

The cache is a :class:`velox_core.VeloxCache` with a :class:`~velox_cam.CamPolicy`: every
attention call adds its queries' softmax weights to each stored token's score; after each
prefill chunk, and during decode at every step (``every=1``) once over ``budget``, the cache
keeps the ``sinks`` first tokens and the newest ones, and the value of each token it evicts
is merged into the ``merge`` tokens kept after it with a probability from the scores.
Attention must be routed to the cache (``velox_core.routed(model)`` or
``velox_core.generate``) for the policy to see the queries; see :mod:`velox_cam.policy` for
the deviations from the authors' cache. The authors keep fp16 tokens; ``bits`` codes the
kept tokens with ``Uniform``.
"""

from __future__ import annotations

from typing import Any

from velox_core.cache.eviction import EvictionCache

from .config import CamConfig
from .policy import CamPolicy

__all__ = ["CamCache"]


class CamCache(EvictionCache):
    """CaM's cache for one layer. Parameters: see :class:`CamConfig`."""

    method = "cam"
    Config = CamConfig
    Policy = CamPolicy

    # each KV head accumulates its own scores and draws its own masks, and every head keeps
    # the same positions, so a split by heads holds exactly its share: mixes_heads stays ""

    def make_policy(self, cfg: CamConfig) -> Any:
        return CamPolicy(budget=cfg.budget, every=cfg.every, merge=cfg.merge, seed=cfg.seed)

    def build(self, cfg: CamConfig) -> dict[str, Any]:
        return {**super().build(cfg), "sinks": cfg.sink_tokens}
