"""Settings of the CaM cache."""

from __future__ import annotations

from dataclasses import dataclass, replace

from velox_core.cache.eviction import EvictionConfig, recent_tokens
from velox_core.validation import check_int

__all__ = ["CamConfig"]


@dataclass
class CamConfig(EvictionConfig):
    """CaM (ICML 2024, https://proceedings.mlr.press/v235/zhang24n.html) settings: the shared
    eviction settings (:class:`~velox_core.cache.eviction.EvictionConfig`), with the authors'
    defaults, the merge size and the seed of the merge draws.

    Attributes:
        budget: tokens kept per KV head: the sinks, then the newest tokens.
        sinks: the first tokens, always kept (the authors' start budget): a whole number of
            tokens, or a fraction in ``[0, 1)`` of ``budget``, rounded down (0.5: the authors'
            even split between the start and the recent tokens).
        every: during decode, cut back to ``budget`` once it is exceeded by ``every`` tokens
            (1: the authors, one eviction and merge per step; None: the prompt only).
        merge: the kept tokens each evicted value is spread over, ``value / merge`` each (16:
            the authors' ``merge_num``); at most ``budget - sinks - window``.
        seed: seed of the merge draws (each layer draws its own stream from it).
        window: newest tokens kept as given (fp16 when ``bits`` is set); values merge into
            the oldest kept tokens, outside it.
        bits, key_bits, value_bits, group: ``Uniform`` codes of the kept tokens (None: fp16,
            as the authors).
    """

    sinks: int | float = 0.5
    every: int | None = 1
    merge: int = 16
    seed: int = 0

    def __post_init__(self):
        if isinstance(self.sinks, float):
            # a share of the budget: every check below runs on the tokens it gives
            check_int("budget", self.budget, minimum=1)
            replace(self, sinks=self.sink_tokens)
            return
        super().__post_init__()
        check_int("merge", self.merge, minimum=1)
        check_int("seed", self.seed, minimum=0)
        kept = self.budget - self.sinks - self.window
        if self.merge > kept:
            raise ValueError(
                f"merge={self.merge} must be at most budget - sinks - window = {kept} (an "
                "evicted value merges into that many of the oldest kept tokens); lower merge "
                "or sinks, or raise budget"
            )

    @property
    def sink_tokens(self) -> int:
        """``sinks`` in tokens (a fraction taken of ``budget``)."""
        return recent_tokens(self.sinks, self.budget, "newest tokens", name="sinks")
