"""Settings of the TOVA cache."""

from __future__ import annotations

from dataclasses import dataclass

from velox_core.cache.eviction import EvictionConfig


@dataclass
class TOVAConfig(EvictionConfig):
    """TOVA (arXiv 2401.06104) settings: the shared eviction settings
    (:class:`~velox_core.cache.eviction.EvictionConfig`), with TOVA's defaults.

    Attributes:
        budget: tokens kept per KV head (the paper's multi-state size): sinks, the body the
            last query attends to most, and the window.
        sinks: first tokens always kept, unscored (0, as the paper).
        window: most recent tokens always kept, unscored (0, as the paper; 1 keeps the
            newest token whatever its weight, as kvpress's ``TOVAPress`` does).
        every: during decode, cut back to ``budget`` once it is exceeded by ``every`` tokens
            (1: the paper, one token per step; None: the prompt only, kvpress's prefill press).
        bits, key_bits, value_bits, group: ``Uniform`` codes of the kept tokens (None: fp16).
    """

    every: int | None = 1
