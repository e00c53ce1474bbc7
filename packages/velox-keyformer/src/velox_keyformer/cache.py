"""``KeyformerCache``: Keyformer's eviction (arXiv 2403.09054) as a velox cache preset.

The cache is a :class:`velox_core.VeloxCache` with a :class:`~velox_keyformer.KeyformerPolicy`:
every attention call adds its queries' Gumbel-softmax scores to each stored token's score;
after each prefill chunk, and during decode at every step (``every=1``) once over
``budget``, the stored tokens are cut to ``budget`` per KV head, keeping the ``recent``
newest tokens and the key tokens (the largest accumulated scores). Attention must be routed
to the cache (``velox_core.routed(model)`` or ``velox_core.generate``); see
:mod:`velox_keyformer.policy` for the deviations from the paper. The paper keeps fp16
tokens; ``bits`` codes the kept tokens with ``Uniform``.
"""

from __future__ import annotations

from typing import Any

from velox_core.cache.eviction import EvictionCache

from .config import KeyformerConfig
from .policy import KeyformerPolicy

__all__ = ["KeyformerCache"]


class KeyformerCache(EvictionCache):
    """Keyformer's cache for one layer. Parameters: see :class:`KeyformerConfig`."""

    method = "keyformer"
    Config = KeyformerConfig
    Policy = KeyformerPolicy

    # each KV head accumulates and keeps its own tokens (its query heads' mean), so a split
    # by heads holds exactly its share: mixes_heads stays ""

    def make_policy(self, cfg: KeyformerConfig) -> Any:
        return KeyformerPolicy(
            budget=cfg.budget,
            every=cfg.every,
            recent=cfg.recent_tokens,
            tau_init=float(cfg.tau_init),
            tau_end=float(cfg.tau_end),
            steps=cfg.steps,
            seed=cfg.seed,
        )
