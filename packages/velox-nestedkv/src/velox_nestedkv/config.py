"""Settings of the NestedKV cache."""

from __future__ import annotations

from dataclasses import dataclass

from velox_core.cache.eviction import EvictionConfig
from velox_core.validation import check_choice, check_float, check_int, check_optional

from .policy import HEADS, check_prior
from .scores import PRIOR


@dataclass
class NestedKVConfig(EvictionConfig):
    """NestedKV (arXiv 2605.26678) settings, with the shared parameter names
    (:class:`~velox_core.cache.eviction.EvictionConfig`).

    Attributes:
        budget: tokens kept per KV head (sinks + body + window); with ``heads="adaptive"``
            the per-head average: the layer keeps ``budget × H`` tokens in all.
        sinks: first tokens always kept in fp16 (the paper pins 4).
        every: during decode, re-compress once the budget is exceeded by ``every`` tokens
            (a velox extension; None compresses only after prompt chunks, as the paper does).
        recent: ``W``, span of the current memory, in tokens (paper: 64).
        block: episodic block size (None: the paper's ``clip(⌊N/32⌋, 128, 256)``, ``N`` the
            tokens seen at the first compression).
        beta: temperature of the head-adaptive blend (paper: 3.0).
        tau: threshold of the surprise gate, on centred normalized surprise (paper: 0.6).
        kappa: sharpness of the surprise gate (paper: 10).
        prior: blend prior of (stable, episodic, current) (paper: 0.4, 0.4, 0.2).
        safeguard: ``α_s``, share of its budget each head keeps by its own ranking (0.2).
        heads: ``"adaptive"`` (the paper's head-wise competition; batch 1, routed attention)
            or ``"uniform"`` (``budget`` tokens per head).
    """

    sinks: int = 4
    recent: int = 64
    block: int | None = None
    beta: float = 3.0
    tau: float = 0.6
    kappa: float = 10.0
    prior: tuple[float, float, float] = PRIOR
    safeguard: float = 0.2
    heads: str = "adaptive"

    def __post_init__(self):
        super().__post_init__()
        check_int("recent", self.recent, minimum=1)
        check_optional(self, "block")
        check_float("beta", self.beta, minimum=0.0)
        check_float("tau", self.tau)
        check_float("kappa", self.kappa, minimum=0.0)
        self.prior = check_prior(self.prior)
        check_float("safeguard", self.safeguard, minimum=0.0, maximum=1.0)
        check_choice("heads", self.heads, HEADS)
