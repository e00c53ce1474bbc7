"""Settings of the StreamingLLM cache."""

from __future__ import annotations

from dataclasses import dataclass

from velox_core import check_kept_codes
from velox_core.validation import check_int


@dataclass
class StreamingLLMConfig:
    """StreamingLLM (arXiv 2309.17453) settings, with the shared parameter names.

    Attributes:
        budget: tokens kept per KV head: the ``sinks`` first tokens plus the most recent ones.
        sinks: attention sinks, the first tokens, always kept (the paper uses 4).
        every: during decode, cut back to ``budget`` once it is exceeded by ``every`` tokens
            (1 is the paper's rolling cache; larger values amortize the gather).
        bits, key_bits, value_bits: code the kept tokens with ``velox_core.Uniform`` at these
            widths (None keeps them in fp16, as the paper does).
        group: group size of the codes.
        window: most recent tokens kept in fp16 when ``bits`` is set.
    """

    budget: int = 1024
    sinks: int = 4
    every: int = 32
    bits: int | None = None
    key_bits: int | None = None
    value_bits: int | None = None
    group: int = 64
    window: int = 0

    def __post_init__(self):
        check_int("budget", self.budget, minimum=1)
        check_int("sinks", self.sinks, minimum=0)
        check_int("every", self.every, minimum=1)
        check_kept_codes(self)
        check_int("window", self.window, minimum=0)
        if self.budget <= self.sinks + self.window:
            raise ValueError(
                f"budget={self.budget} must exceed sinks + window = {self.sinks + self.window}"
            )
