"""Settings of the RocketKV cache."""

from __future__ import annotations

from dataclasses import dataclass

from velox_core.cache.eviction import EvictionConfig
from velox_core.policy import WindowVote

from .sparse import sparse_settings
from .split import body_capacity

__all__ = ["RocketKVConfig"]


@dataclass
class RocketKVConfig(EvictionConfig):
    """RocketKV (arXiv 2502.14051) settings, with the shared parameter names
    (:class:`~velox_core.cache.eviction.EvictionConfig`).

    Attributes:
        budget: per KV head, everything a layer keeps: sinks, window, the body tokens
            SnapKV++ keeps and one token for each page summary of the body (a key minimum and
            maximum: a token's key and value in size). ``budget=1024`` with 3-token pages keeps
            768 tokens and their 256 summaries.
        every: during decode, cut again once the kept tokens are exceeded by ``every`` (None,
            the paper: evict at prefill only and keep every generated token; 32 bounds a
            long generation, at the cost of keeping the observation window's queries).
        observe: SnapKV++'s observation window (the paper's window size, 32).
        kernel: odd pooling kernel of the votes (the authors' code: 63).
        pooling: ``"max"`` (the authors' code) or ``"avg"``.
        ratio: the second stage's compression ``c2`` >= 1: kept body tokens over the tokens'
            worth a decode step reads (6.0: the paper's split at an 8x to 32x eviction;
            None: no second stage, every kept token attended, no page summaries).
        topk: tokens attended exactly per decode step and KV head (None: half of the body
            budget over ``ratio``: 64 of 768).
        page: body tokens per page summary (None: ``min(floor(ratio), ceil(sqrt(ratio)))``, 3).
        channels: key channels of the approximate scores, a count or a fraction of the head
            dim (None: ``round(D page / ratio)``, half the channels at the default ratio).
    """

    observe: int = 32
    kernel: int = 63
    pooling: str = "max"
    ratio: float | None = 6.0
    topk: int | None = None
    page: int | None = None
    channels: int | float | None = None

    def __post_init__(self):
        super().__post_init__()
        WindowVote(self.observe, self.kernel, self.pooling)  # raises on a bad setting
        self.stage2 = sparse_settings(self.ratio, self.topk, self.page, self.channels)
        page = None if self.stage2 is None else self.stage2.page_size
        body = body_capacity(self.budget - self.sinks - self.window, page)
        need = max(0, self.observe - self.window)
        if body <= need:
            raise ValueError(
                f"budget={self.budget} leaves {body} body tokens beside their page summaries "
                f"(page={page}) after sinks={self.sinks} and window={self.window}; they must "
                f"exceed the {need} observation-window tokens (observe={self.observe}) so that "
                "at least one voted token fits: raise budget"
            )

    def check_dims(self, key_dim: int, value_dim: int) -> None:
        """``channels`` (a count) must not exceed the key head dim."""
        if self.stage2 is not None:
            self.stage2.channel_count(key_dim)
