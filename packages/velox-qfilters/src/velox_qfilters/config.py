"""Settings of the Q-Filters cache."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from velox_core.cache.eviction import EvictionConfig
from velox_core.validation import check_optional, check_path


@dataclass
class QFiltersConfig(EvictionConfig):
    """Q-Filters (arXiv 2503.02812) settings, with the shared parameter names
    (:class:`~velox_core.cache.eviction.EvictionConfig`).

    Attributes:
        budget: tokens kept per KV head: sinks + the best-scored body tokens + the window.
        sinks: first tokens always kept (the authors' cache keeps none: 0).
        window: most recent tokens always kept, unscored and in fp16 (the authors' cache keeps
            a window of recent tokens; their example uses 64).
        every: during decode, cut back to ``budget`` once it is exceeded by ``every`` tokens
            (1 is the authors' evict-every-step cache; larger values amortize the gather).
        filters: path of the Q-Filters artifact; None finds the one fitted for the model
            (``$VELOX_ARTIFACTS``, then ``~/.cache/velox``) when the cache is bound.
        layer: the model layer whose filters to use; ``velox_core.make_cache`` sets it.
    """

    every_none: ClassVar[bool] = False

    window: int = 64
    every: int = 32
    filters: str | None = None
    layer: int | None = None

    def __post_init__(self):
        super().__post_init__()
        self.filters = check_path("filters", self.filters)
        check_optional(self, "layer", minimum=0)
