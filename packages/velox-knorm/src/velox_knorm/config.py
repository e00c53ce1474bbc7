"""Settings of the KNorm cache."""

from __future__ import annotations

from dataclasses import dataclass

from velox_core.cache.eviction import EvictionConfig


@dataclass
class KNormConfig(EvictionConfig):
    """KNorm (arXiv 2406.11430) settings: the shared eviction settings
    (:class:`~velox_core.cache.eviction.EvictionConfig`), with KNorm's defaults.

    Attributes:
        budget: tokens kept per KV head: sinks, the lowest-norm body tokens and the window.
        sinks: first tokens always kept, unscored (0: the paper keeps none by rule; sink
            tokens usually have low-norm keys and are kept by the score itself).
        window: most recent tokens always kept, unscored (0, as the paper and kvpress).
        every: during decode, cut back to ``budget`` once it is exceeded by ``every`` tokens
            (None: the paper's prompt-only compression; generated tokens accumulate).
        bits, key_bits, value_bits, group: ``Uniform`` codes of the kept tokens (None: fp16).
    """
