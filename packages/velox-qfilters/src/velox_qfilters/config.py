"""Settings of the Q-Filters cache."""

from __future__ import annotations

import os
from dataclasses import dataclass

from velox_core import check_kept_codes
from velox_core.validation import check_int


@dataclass
class QFiltersConfig:
    """Q-Filters (arXiv 2503.02812) settings, with the shared parameter names.

    Attributes:
        budget: tokens kept per KV head: sinks + the best-scored body tokens + the window.
        sinks: first tokens always kept (the authors' cache keeps none: 0).
        window: most recent tokens always kept, unscored and in fp16 (the authors' cache keeps
            a window of recent tokens; their example uses 64).
        every: during decode, cut back to ``budget`` once it is exceeded by ``every`` tokens
            (1 is the authors' evict-every-step cache; larger values amortize the gather).
        bits, key_bits, value_bits: code the kept tokens with ``velox_core.Uniform`` at these
            widths (None keeps them in fp16, as the paper does).
        group: group size of those codes.
        filters: path of the Q-Filters artifact; None finds the one fitted for the model
            (``$VELOX_ARTIFACTS``, then ``~/.cache/velox``) when the cache is bound.
        layer: the model layer whose filters to use; ``velox_core.make_cache`` sets it.
    """

    budget: int = 1024
    sinks: int = 0
    window: int = 64
    every: int = 32
    bits: int | None = None
    key_bits: int | None = None
    value_bits: int | None = None
    group: int = 64
    filters: str | None = None
    layer: int | None = None

    def __post_init__(self):
        check_int("budget", self.budget, minimum=1)
        check_int("sinks", self.sinks, minimum=0)
        check_int("window", self.window, minimum=0)
        check_int("every", self.every, minimum=1)
        check_kept_codes(self)
        if self.filters is not None:
            if not isinstance(self.filters, (str, os.PathLike)):
                raise TypeError(f"filters must be a path or None, got {self.filters!r}")
            self.filters = os.fspath(self.filters)
        if self.layer is not None:
            check_int("layer", self.layer, minimum=0)
        if self.budget <= self.sinks + self.window:
            raise ValueError(
                f"budget={self.budget} must exceed sinks + window = {self.sinks + self.window}"
            )
