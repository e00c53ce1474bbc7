"""Settings of the ChunkKV cache."""

from __future__ import annotations

import math
from dataclasses import dataclass
from numbers import Integral, Real

from velox_core.cache.eviction import EvictionConfig
from velox_core.policy import WindowVote

__all__ = ["ChunkKVConfig", "check_chunk_length", "check_count", "check_reuse", "check_room"]


def check_count(name: str, value, what: str) -> int:
    """A whole number >= 1 (``what`` says what it counts), else ``ValueError`` naming ``name``
    and what is allowed: floats (NaN and infinities included), bools and strings are refused."""
    if isinstance(value, Integral) and not isinstance(value, bool) and value >= 1:
        return int(value)
    if isinstance(value, Real) and not isinstance(value, bool) and not math.isfinite(value):
        got = f"a non-finite number ({value})"
    else:
        got = repr(value)
    raise ValueError(f"{name} must be a whole number >= 1 ({what}), got {got}")


def check_chunk_length(value) -> int:
    """Tokens per chunk: a whole number >= 1 (1: each token a chunk, SnapKV's selection)."""
    return check_count("chunk_length", value, "consecutive tokens per chunk")


def check_reuse(value) -> int:
    """Adjacent layers sharing one layer's selection: a whole number >= 1 (1: no reuse)."""
    return check_count(
        "reuse", value, "adjacent layers that keep the first one's chunks; 1 turns reuse off"
    )


def check_room(budget: int, always: int, chunk_length: int) -> None:
    """``budget`` leaves room for one whole chunk beyond the tokens always kept."""
    if budget < always + chunk_length:
        raise ValueError(
            f"budget={budget} must be at least sinks + max(window, observe) + chunk_length = "
            f"{always} + {chunk_length} = {always + chunk_length} (those tokens are always kept, "
            "and at least one whole chunk must fit beside them); raise budget or lower "
            "chunk_length"
        )


@dataclass
class ChunkKVConfig(EvictionConfig):
    """ChunkKV (arXiv 2502.00299) settings, with the shared parameter names
    (:class:`~velox_core.cache.eviction.EvictionConfig`).

    Attributes:
        budget: tokens kept per KV head: sinks, the kept chunks and the observation window
            (the paper's ``L_max``); at least ``sinks + max(window, observe) + chunk_length``.
        sinks: first tokens always kept (not in the paper; 0 by default).
        every: during decode, cut again once the cache exceeds ``budget`` by ``every`` tokens
            (None: the paper, which compresses the prompt only).
        observe: the observation window: how many of the newest queries vote, and how many of
            the newest tokens are always kept (the paper's ``w``; SnapKV's 32).
        kernel: odd pooling kernel along tokens before the votes are summed per chunk (1, the
            paper's Algorithm 1: the chunks do the clustering; kvpress's SnapKV scorer pools
            with 5).
        pooling: ``"max"`` or ``"avg"`` (read only with ``kernel > 1``).
        chunk_length: consecutive tokens per chunk (the paper's ``c``; 10, its default;
            kvpress's is 20).
        reuse: adjacent ChunkKV layers that keep the chunks the first of them chose (the
            paper's layer-wise index reuse, ``N_reuse``); 1, the default, turns it off (each
            layer chooses its own, as kvpress and the paper's accuracy tables).
    """

    observe: int = 32
    kernel: int = 1
    pooling: str = "max"
    chunk_length: int = 10
    reuse: int = 1

    def __post_init__(self):
        super().__post_init__()
        WindowVote(self.observe, self.kernel, self.pooling)  # raises on a bad setting
        self.chunk_length = check_chunk_length(self.chunk_length)
        self.reuse = check_reuse(self.reuse)
        check_room(self.budget, self.sinks + max(self.window, self.observe), self.chunk_length)
