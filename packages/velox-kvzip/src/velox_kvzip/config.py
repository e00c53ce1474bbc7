"""Settings of the KVzip cache, and the checks its policy shares."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from velox_core.cache.eviction import EvictionConfig
from velox_core.cache.preset import check_kept_codes
from velox_core.validation import check_choice, check_counts, check_int

__all__ = [
    "HEADS",
    "PROMPT",
    "PROMPT_NEXT",
    "KVzipConfig",
    "budget_share",
    "check_prompts",
    "kept_tokens",
]

# how the kept KV pairs are shared out: one ranking over every layer's and KV head's pairs
# (the paper's default), one per layer over its heads (kvpress's layerwise=True), or the
# same count in every KV head (the paper's uniform head budget)
HEADS = ("global", "layer", "uniform")
# the repeat instructions (kvpress's KVzipPress; the authors' second one ends in a space)
PROMPT = "\n\nRepeat the previous context exactly."
PROMPT_NEXT = "\n\nRepeat the part of the previous context exactly, starting with"
_SHARE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*%\s*$")


def budget_share(budget) -> float | None:
    """``budget`` as a share of the context in ``(0, 1]`` (a string ``"P%"``), or None for a
    count of tokens (an int >= 1); anything else raises, naming ``budget``."""
    if isinstance(budget, str):
        m = _SHARE.match(budget)
        share = float(m.group(1)) / 100 if m else math.nan
        if not 0 < share <= 1:
            raise ValueError(
                f"budget must be a whole number of tokens per KV head or a share of the "
                f"context 'P%' with 0 < P <= 100, got {budget!r}"
            )
        return share
    check_int("budget", budget, minimum=1)
    return None


def kept_tokens(budget, context: int) -> int:
    """Tokens per KV head ``budget`` keeps of a ``context``-token context: the count as given,
    or the share of the context rounded (at least 1)."""
    share = budget_share(budget)
    return budget if share is None else max(1, round(share * context))


def check_prompts(prompt, prompt_next, suffix, overlap) -> None:
    """The repeat instructions and the text between them and the repeated tokens."""
    for name, text in (("prompt", prompt), ("prompt_next", prompt_next), ("suffix", suffix)):
        if not isinstance(text, str):
            raise TypeError(f"{name} must be a string, got {type(text).__name__} {text!r}")
    if not prompt.strip():
        raise ValueError("prompt must hold the repeat instruction (it is empty)")
    check_int("overlap", overlap, minimum=0)


@dataclass
class KVzipConfig(EvictionConfig):
    """KVzip (arXiv 2505.23416) settings, with the shared eviction names
    (:class:`~velox_core.cache.eviction.EvictionConfig`).

    Attributes:
        budget: tokens kept per KV head, on average over the heads (and layers) that share
            a ranking (``heads``): a whole number, or ``"P%"``, a share of the context the
            reconstruction scores (resolved by :func:`velox_kvzip.compress`).
        sinks: first tokens always kept (kvpress's ``n_sink=4``; the authors keep their
            system prompt); they also enter every chunk's softmax, as in both.
        window: newest context tokens always kept (0, as the paper).
        every: None only: KVzip cuts the context once, in :func:`velox_kvzip.compress`, and
            the tokens that follow (question, answer) are all kept.
        bits, key_bits, value_bits, group: ``Uniform`` codes of the kept tokens (None:
            fp16, as the paper); the reconstruction then scores the coded keys.
        heads: ``"global"`` (one ranking of every layer's and head's pairs: the paper's
            head- and layer-wise budgets, kvpress's default), ``"layer"`` (each layer keeps
            ``budget x H`` pairs, ranked over its heads: kvpress's ``layerwise=True``) or
            ``"uniform"`` (each KV head keeps ``budget``: the paper's uniform head budget).
        chunk: context tokens reconstructed per forward (kvpress 2048, the authors 2000).
        prompt: the repeat instruction before the first chunk.
        prompt_next: the instruction before each later chunk, followed by the previous
            chunk's last ``overlap`` tokens.
        overlap: tokens of the previous chunk repeated after ``prompt_next`` (8, as both).
        suffix: text between the instruction and the repeated tokens (``"\\n"``: kvpress
            without a chat template; with one, its assistant header).
    """

    budget: int | str = 1024
    sinks: int = 4
    heads: str = "global"
    chunk: int = 2048
    prompt: str = PROMPT
    prompt_next: str = PROMPT_NEXT
    overlap: int = 8
    suffix: str = "\n"

    def __post_init__(self):
        share = budget_share(self.budget)
        if share is None:
            super().__post_init__()
        else:  # the checks of EvictionConfig that do not need a count of tokens
            check_counts(self, "sinks", "window")
            check_kept_codes(self)
        if self.every is not None:
            raise ValueError(
                f"every={self.every!r}: KVzip cuts the context once, in "
                "velox_kvzip.compress, and keeps every later token; every must be None"
            )
        check_choice("heads", self.heads, HEADS)
        check_int("chunk", self.chunk, minimum=1)
        check_prompts(self.prompt, self.prompt_next, self.suffix, self.overlap)
