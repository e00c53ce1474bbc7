"""Settings of the Keyformer cache."""

from __future__ import annotations

from dataclasses import dataclass

from velox_core.cache.eviction import RecentConfig
from velox_core.validation import check_int

__all__ = ["KeyformerConfig"]


@dataclass
class KeyformerConfig(RecentConfig):
    """Keyformer (arXiv 2403.09054) settings: the shared eviction settings with a recent
    window (:class:`~velox_core.cache.eviction.RecentConfig`) and Keyformer's own.

    Attributes:
        budget: tokens kept per KV head: sinks, key tokens, recent tokens.
        recent: the newest tokens always kept: a whole number of tokens, or a fraction in
            ``[0, 1)`` of ``budget`` (0.3: the authors' default, 30% of the cache).
        tau_init: the Gumbel softmax's temperature for the prompt (1.0, the paper's).
        tau_end: its temperature after ``steps`` decode steps (2.0, the paper's).
        steps: decode steps over which the temperature rises linearly (the paper's text
            generation length); it stays at ``tau_end`` afterwards.
        seed: seed of the Gumbel noise (each layer draws its own stream from it).
        sinks, window: first and newest tokens kept as given (0, as the paper); the window
            counts among the recent tokens.
        every: during decode, cut back to ``budget`` once it is exceeded by ``every`` tokens
            (1: the paper, one eviction per step; None: the prompt only).
        bits, key_bits, value_bits, group: ``Uniform`` codes of the kept tokens (None: fp16).
    """

    scored = ("key token", "key tokens")

    every: int | None = 1
    recent: int | float = 0.3
    tau_init: float = 1.0
    tau_end: float = 2.0
    steps: int = 512
    seed: int = 0

    def __post_init__(self):
        super().__post_init__()
        for name in ("tau_init", "tau_end"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise TypeError(f"{name} must be a positive number, got {value!r}")
            if not value > 0 or value == float("inf"):
                raise ValueError(f"{name}={value}: the temperature must be positive and finite")
        check_int("steps", self.steps, minimum=1)
        check_int("seed", self.seed, minimum=0)
        self.check_recent()
