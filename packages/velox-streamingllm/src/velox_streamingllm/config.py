"""Settings of the StreamingLLM cache."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from velox_core.cache.eviction import EvictionConfig


@dataclass
class StreamingLLMConfig(EvictionConfig):
    """StreamingLLM (arXiv 2309.17453) settings: the shared eviction settings
    (:class:`~velox_core.cache.eviction.EvictionConfig`), with StreamingLLM's defaults.

    Attributes:
        budget: tokens kept per KV head: the ``sinks`` first tokens plus the most recent ones.
        sinks: attention sinks, the first tokens, always kept (the paper uses 4).
        every: during decode, cut back to ``budget`` once it is exceeded by ``every`` tokens
            (1 is the paper's rolling cache; larger values amortize the gather).
    """

    every_none: ClassVar[bool] = False

    sinks: int = 4
    every: int = 32
