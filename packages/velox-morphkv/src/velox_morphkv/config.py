"""Settings of the MorphKV cache."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from velox_core.cache.eviction import EvictionConfig
from velox_core.policy import check_fusion
from velox_core.validation import check_bool, check_int

__all__ = ["MorphKVConfig"]


@dataclass
class MorphKVConfig(EvictionConfig):
    """MorphKV (arXiv 2503.00979) settings: the shared eviction settings
    (:class:`~velox_core.cache.eviction.EvictionConfig`), with MorphKV's defaults, its recent
    window and its fusion.

    Attributes:
        budget: tokens kept per KV head (the paper's total capacity ``C + R``): sinks, the
            recent window and the older tokens it attends to most (1024: the paper's
            LongBench fusion study, with a 32-token window).
        observe: the recent window ``R``: how many of the newest queries vote, and how many of
            the newest tokens are always kept (32: the paper's LongBench setting; 30 and 200
            in its long-response runs).
        fusion: how the window's attention weights on a token combine: ``"sum"`` (equation 5,
            the paper's LongWriter and LongBench runs) or ``"max"`` (equation 6, its
            LongGenBench runs).
        every: during decode, re-select once ``budget`` is exceeded by ``every`` tokens (1:
            the paper, every step; 8: its coarse-grained variant). MorphKV evicts during
            decode by design: None is refused.
        sinks: first tokens always kept, unscored (0, as the paper).
        window: newest tokens kept as given, unscored and uncoded (0); they count among the
            ``observe`` newest tokens, so ``max(observe, window)`` newest tokens are kept.
        bits, key_bits, value_bits, group: ``Uniform`` codes of the kept tokens (None: fp16,
            as the paper).
        prefill: ``"chunks"`` (a cut after each prefill chunk; peak memory ``budget`` plus one
            chunk) or ``"prompt"`` (the whole prompt held and cut once at its end, voted by
            its last ``observe`` queries, as the authors' code).
        keep_weights: keep the window's weights from one cut to the next as the authors do
            (True, the default: one bfloat16 row per KV head and query, the softmax
            numerators of the KV head's query heads' summed logits, ``H × observe × (budget +
            every + 1)`` a sequence and layer, renormalized over the older tokens at each
            cut), or keep the window's queries and score them against the stored keys again
            at every cut (False: each query head's softmax over every token it sees, the
            paper's ``AW_r``; ``observe × Hq × D`` in the queries' dtype and ``observe × Hq ×
            budget`` dot products and exponentials a cut).
    """

    every_none: ClassVar[bool] = False

    every: int = 1
    observe: int = 32
    fusion: str = "sum"
    keep_weights: bool = True

    def __post_init__(self):
        if self.every is None:
            raise ValueError(
                "every=None: MorphKV re-selects the kept tokens during decode (that bounds a "
                "long response); every must be a whole number of decode steps >= 1 (1: the "
                "paper, 8: its coarse-grained eviction). For a prompt-only cut use snapkv"
            )
        super().__post_init__()
        check_int("observe", self.observe, minimum=1)
        check_fusion(self.fusion)
        check_bool("keep_weights", self.keep_weights)
        always = self.sinks + max(self.window, self.observe)
        if self.budget <= always:
            raise ValueError(
                f"budget={self.budget} must exceed sinks + max(window, observe) = {always} "
                "(the recent window is always kept, and at least one older token must fit)"
            )
