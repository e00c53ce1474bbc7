"""Settings of the SnapKV cache."""

from __future__ import annotations

from dataclasses import dataclass

from velox_core import check_kept_codes
from velox_core.validation import check_int

from .votes import check_kernel, check_pooling


@dataclass
class SnapKVConfig:
    """SnapKV (arXiv 2404.14469) settings, with the shared parameter names.

    Attributes:
        budget: tokens kept per KV head: sinks, voted prompt tokens and the observation window
            (the paper's ``max_capacity_prompt``).
        observe: the observation window: how many of the newest queries vote, and how many of
            the newest tokens are always kept (the paper's ``window_size``, 32).
        kernel: odd pooling kernel along tokens (the paper's experiments use 7; 1 = no pooling).
        pooling: ``"max"`` (the paper's experiments) or ``"avg"`` (its code's default).
        every: during decode, evict again once the cache exceeds ``budget`` by ``every``
            tokens, voting with the latest decode queries (None: the paper, which compresses
            the prompt only and lets generated tokens accumulate).
        sinks: first tokens always kept (not in the paper; 0 by default).
        bits, key_bits, value_bits: code the kept tokens with ``velox_core.Uniform`` at these
            widths (None keeps them in fp16, as the paper does).
        group: group size of the codes.
        window: most recent tokens kept as given (fp16) when ``bits`` is set.
    """

    budget: int = 1024
    observe: int = 32
    kernel: int = 7
    pooling: str = "max"
    every: int | None = None
    sinks: int = 0
    bits: int | None = None
    key_bits: int | None = None
    value_bits: int | None = None
    group: int = 64
    window: int = 0

    def __post_init__(self):
        check_int("budget", self.budget, minimum=1)
        check_int("observe", self.observe, minimum=1)
        check_kernel(self.kernel)
        check_pooling(self.pooling)
        if self.every is not None:
            check_int("every", self.every, minimum=1)
        check_int("sinks", self.sinks, minimum=0)
        check_kept_codes(self)
        check_int("window", self.window, minimum=0)
        if self.budget <= self.sinks + max(self.window, self.observe):
            raise ValueError(
                f"budget={self.budget} must exceed sinks + max(window, observe) = "
                f"{self.sinks + max(self.window, self.observe)} (those tokens are always kept; "
                "at least one voted prompt token must fit)"
            )
