"""Settings of the SnapKV cache."""

from __future__ import annotations

from dataclasses import dataclass

from velox_core.cache.eviction import EvictionConfig
from velox_core.policy import WindowVote


@dataclass
class SnapKVConfig(EvictionConfig):
    """SnapKV (arXiv 2404.14469) settings, with the shared parameter names
    (:class:`~velox_core.cache.eviction.EvictionConfig`).

    Attributes:
        budget: tokens kept per KV head: sinks, voted prompt tokens and the observation window
            (the paper's ``max_capacity_prompt``).
        sinks: first tokens always kept (not in the paper; 0 by default).
        every: during decode, evict again once the cache exceeds ``budget`` by ``every``
            tokens, voting with the latest decode queries (None: the paper, which compresses
            the prompt only and lets generated tokens accumulate).
        observe: the observation window: how many of the newest queries vote, and how many of
            the newest tokens are always kept (the paper's ``window_size``, 32).
        kernel: odd pooling kernel along tokens (the paper's experiments use 7; 1 = no pooling).
        pooling: ``"max"`` (the paper's experiments) or ``"avg"`` (its code's default).
    """

    observe: int = 32
    kernel: int = 7
    pooling: str = "max"

    def __post_init__(self):
        super().__post_init__()
        WindowVote(self.observe, self.kernel, self.pooling)  # raises on a bad setting
        if self.budget <= self.sinks + max(self.window, self.observe):
            raise ValueError(
                f"budget={self.budget} must exceed sinks + max(window, observe) = "
                f"{self.sinks + max(self.window, self.observe)} (those tokens are always kept; "
                "at least one voted prompt token must fit)"
            )
