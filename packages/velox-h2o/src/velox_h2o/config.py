"""Settings of the H2O cache."""

from __future__ import annotations

from dataclasses import dataclass

from velox_core.cache.eviction import RecentConfig

__all__ = ["H2OConfig"]


@dataclass
class H2OConfig(RecentConfig):
    """H2O (arXiv 2306.14048) settings: the shared eviction settings with a recent window
    (:class:`~velox_core.cache.eviction.RecentConfig`), with H2O's defaults.

    Attributes:
        budget: tokens kept per KV head (the paper's KV cache budget): sinks, the heavy
            hitters, the recent tokens.
        recent: the newest tokens always kept (the paper's recent window): a whole number of
            tokens, or a fraction in ``[0, 1)`` of ``budget`` (0.5: the paper's even split
            between heavy hitters and recent tokens). The rest of the budget, after the
            sinks, holds the heavy hitters: the tokens with the largest attention
            accumulated over every query so far.
        sinks: first tokens always kept, unscored (0, as the paper).
        window: newest tokens kept as given, unscored and uncoded (0); they count among the
            ``recent`` tokens, so ``max(recent, window)`` newest tokens are always kept.
        every: during decode, cut back to ``budget`` once it is exceeded by ``every`` tokens
            (1: the paper, one eviction per step; None: the prompt only).
        bits, key_bits, value_bits, group: ``Uniform`` codes of the kept tokens (None: fp16,
            as the paper).
    """

    scored = ("heavy hitter", "heavy hitters")

    every: int | None = 1
    recent: int | float = 0.5

    def __post_init__(self):
        super().__post_init__()
        self.check_recent()
