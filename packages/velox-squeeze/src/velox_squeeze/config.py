"""Settings of the SqueezeAttention cache."""

from __future__ import annotations

from dataclasses import dataclass

from velox_core.cache.eviction import EvictionConfig
from velox_core.policy import WindowVote
from velox_core.validation import check_choice, check_float

__all__ = ["BASES", "SNAPKV_DEFAULTS", "SqueezeConfig", "check_base", "check_p"]

# the policy that chooses the tokens inside each layer's budget: SnapKV's observation-window
# votes, or StreamingLLM's most recent tokens after the sinks (sinks=0: a sliding window)
BASES = ("snapkv", "streamingllm")
SNAPKV_DEFAULTS = {"observe": 32, "kernel": 7, "pooling": "max"}


def check_p(p) -> float:
    """The squeeze factor: a number in ``[0, 1]`` (1: no layer is squeezed)."""
    return check_float("p", p, minimum=0.0, maximum=1.0)


def check_base(base, observe, kernel, pooling) -> dict:
    """The base policy and its vote settings: SnapKV's (None: its defaults, 32 / 7 /
    ``"max"``), or none for StreamingLLM, which has no vote (refused where given)."""
    check_choice("base", base, BASES)
    given = {"observe": observe, "kernel": kernel, "pooling": pooling}
    if base != "snapkv":
        bad = [k for k, v in given.items() if v is not None]
        if bad:
            raise ValueError(
                f"{', '.join(bad)} apply to base='snapkv' only (its observation window's vote); "
                f"base={base!r} keeps the most recent tokens"
            )
        return {}
    vote = {k: SNAPKV_DEFAULTS[k] if v is None else v for k, v in given.items()}
    WindowVote(**vote)  # raises on a bad setting, naming it
    return vote


@dataclass
class SqueezeConfig(EvictionConfig):
    """SqueezeAttention (arXiv 2404.04793) settings, with the shared parameter names
    (:class:`~velox_core.cache.eviction.EvictionConfig`).

    Attributes:
        budget: tokens kept per KV head, **averaged over the layers** (sinks, the tokens the
            base policy keeps, the window): the whole model keeps ``n_layers x budget``, the
            squeezed layers fewer, the others more (:mod:`velox_squeeze.allocate`).
        p: the squeeze factor: each layer of the least important group (the highest cosine
            between its attention's input and output) selects ``p`` times the average share
            of selected tokens (0.4; the authors' example for Mistral-7B is 0.08 / 0.21).
        base: what chooses the tokens inside each layer's budget: ``"snapkv"`` (the
            observation window's pooled votes, as velox-snapkv and velox-pyramidkv) or
            ``"streamingllm"`` (the ``sinks`` first tokens and the most recent ones; with
            ``sinks=0`` the paper's sliding window).
        every: during decode, cut a layer again once it exceeds its budget by ``every``
            tokens (32; the authors' code cuts at every step; None: the prompt only).
        observe, kernel, pooling: SnapKV's observation window, pooling kernel and pooling
            (None: 32, 7 and ``"max"``); ``base="snapkv"`` only.
        sinks, window, bits, key_bits, value_bits, group, prefill: as every eviction preset.
    """

    every: int | None = 32
    p: float = 0.4
    base: str = "snapkv"
    observe: int | None = None
    kernel: int | None = None
    pooling: str | None = None

    def __post_init__(self):
        super().__post_init__()
        self.p = check_p(self.p)
        vote = check_base(self.base, self.observe, self.kernel, self.pooling)
        always = self.sinks + max(self.window, vote.get("observe", 0))
        if self.budget <= always:
            raise ValueError(
                f"budget={self.budget} must exceed sinks + max(window, observe) = {always} "
                "(every layer keeps those tokens; the allocation shares out the rest)"
            )
