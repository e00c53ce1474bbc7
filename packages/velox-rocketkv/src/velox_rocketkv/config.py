"""Settings of the RocketKV cache."""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx

from velox_core.cache.eviction import EvictionConfig
from velox_core.cache.preset import kept_codecs
from velox_core.codec.identity import Identity
from velox_core.policy import WindowVote

from .pages import summary_weight
from .sparse import sparse_settings
from .split import body_capacity

__all__ = ["RocketKVConfig"]


@dataclass
class RocketKVConfig(EvictionConfig):
    """RocketKV (arXiv 2502.14051) settings, with the shared parameter names
    (:class:`~velox_core.cache.eviction.EvictionConfig`).

    Attributes:
        budget: per KV head, everything a layer keeps: sinks, window, the body tokens
            SnapKV++ keeps and the page summaries of the body, each at its bytes over a kept
            token's (a key minimum and maximum: one token's worth in fp16, about 3.2 for 4-bit
            codes). ``budget=1024`` with 3-token pages keeps 768 fp16 tokens and their 256
            summaries, or 495 tokens in 4-bit codes.
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
        self._check_room(1.0)  # fp16 tokens; check_dims again with the codes' bytes

    def check_dims(self, key_dim: int, value_dim: int) -> None:
        """``channels`` (a count) must not exceed the key head dim, and with the tokens' codes
        (``bits``) at these widths the budget must still leave a voted token beside the
        summaries (fp16 storage)."""
        if self.stage2 is None:
            return
        self.stage2.channel_count(key_dim)
        codecs = kept_codecs(self)
        ident = Identity()
        try:  # a code width these head dims refuse (group=32 at head dim 80) names the method
            w = summary_weight(
                codecs.get("key_codec", ident),
                codecs.get("value_codec", ident),
                key_dim,
                value_dim,
                mx.float16,
            )
        except ValueError as exc:
            raise ValueError(f"rocketkv: {exc}") from None
        self._check_room(w)

    def _check_room(self, weight: float) -> None:
        page = None if self.stage2 is None else self.stage2.page_size
        body = body_capacity(self.budget - self.sinks - self.window, page, weight)
        need = max(0, self.observe - self.window)
        if body <= need:
            raise ValueError(
                f"budget={self.budget} leaves {body} body tokens beside their page summaries "
                f"(page={page}, a summary the bytes of {weight:.2f} kept tokens) after "
                f"sinks={self.sinks} and window={self.window}; they must exceed the {need} "
                f"observation-window tokens (observe={self.observe}) so that at least one "
                "voted token fits: raise budget"
            )
