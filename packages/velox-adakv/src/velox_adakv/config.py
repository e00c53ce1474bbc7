"""Settings of the Ada-KV cache."""

from __future__ import annotations

from dataclasses import dataclass

from velox_core.cache.eviction import EvictionConfig
from velox_core.policy import WindowVote
from velox_core.validation import check_choice, check_float

__all__ = ["BASES", "AdaKVConfig"]

BASES = ("snapkv", "qfilters")


@dataclass
class AdaKVConfig(EvictionConfig):
    """Ada-KV (arXiv 2407.11550) settings, with the shared parameter names
    (:class:`~velox_core.cache.eviction.EvictionConfig`).

    Attributes:
        budget: tokens kept per KV head *on average* (sinks + body + window): the layer keeps
            ``budget x H_kv`` tokens, shared among its heads by the adaptive allocation.
        sinks: first tokens always kept (0: Ada-KV and SnapKV keep none).
        window: most recent tokens always kept (SnapKV's observation window, kept in full;
            32 as in the paper's code). Kept in fp16 when ``bits`` is set.
        every: during decode, cut back to the budget once the layer exceeds it by ``every``
            tokens per head (None: evict only after prefill chunks, as the paper compresses
            the prompt and appends decoded tokens).
        alpha: safeguard: each head keeps at least ``floor(alpha x uniform share)`` of its best
            tokens; the rest of the layer budget goes to the best tokens of all heads jointly.
            1.0 is SnapKV's uniform split.
        observe: queries in the observation window (the last ones seen; 32 in the paper).
        kernel: pooling width over neighbouring positions (odd; 7 in the paper's code).
        pooling: ``"max"`` (the paper's code) or ``"avg"``.
        base: the per-token scorer: ``"snapkv"`` (built in) or ``"qfilters"`` (the optional
            ``velox_qfilters`` package's per-key scores).
    """

    window: int = 32
    alpha: float = 0.2
    observe: int = 32
    kernel: int = 7
    pooling: str = "max"
    base: str = "snapkv"

    def __post_init__(self):
        super().__post_init__()
        check_float("alpha", self.alpha, minimum=0.0, maximum=1.0)
        WindowVote(self.observe, self.kernel, self.pooling)  # raises on a bad setting
        check_choice("base", self.base, BASES)
