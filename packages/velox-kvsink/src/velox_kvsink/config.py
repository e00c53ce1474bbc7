"""Settings of the KVSink cache."""

from __future__ import annotations

from dataclasses import dataclass

from velox_core import CodeWidths
from velox_core.validation import (
    check_counts,
    check_float,
    check_int,
    check_token_groups,
    check_widths,
)

__all__ = ["KVSinkConfig"]


@dataclass
class KVSinkConfig(CodeWidths):
    """KVSink (arXiv 2508.04257) settings on a KIVI base, with the shared parameter names.

    Attributes:
        bits: code width of keys and values, 2 to 8 (the paper's headline is 2).
        key_bits, value_bits: either alone (default ``bits``).
        group: KIVI's group size: ``group`` tokens per key channel group, ``group`` channels
            per value group.
        window: most recent tokens kept in fp16 (KIVI's residual ``R``).
        sinks: first tokens always kept exact (the Preserve-First-N baseline; 0 by default,
            KVSink predicts them instead).
        outlier: a token is predicted to be a sink when, in some KV head, its value norm is
            at most ``1 / outlier`` times the median value norm or its key norm at least
            ``outlier`` times the median key norm (medians over the fp16 window and the
            incoming tokens). Greater than 1.
        max_sinks: at most this many predicted sinks per layer (besides the first ``sinks``);
            0 turns prediction off (then only the first ``sinks`` are kept: KIVI with sinks).
    """

    bits: int | float = 2
    group: int = 32
    window: int = 128
    sinks: int = 0
    outlier: float = 2.0
    max_sinks: int = 8

    def __post_init__(self):
        check_widths(self, bits_required=True)
        check_int("group", self.group, minimum=1)
        check_counts(self, "window", "sinks", "max_sinks")
        self.outlier = check_float("outlier", self.outlier, minimum=1.0, open_min=True)

    def check_dims(self, key_dim: int, value_dim: int) -> None:
        """Values are quantized per token in groups of ``group`` channels, so ``group`` must
        divide the value head dim (key groups run along tokens: any key head dim works)."""
        check_token_groups("kvsink", self.group, key_dim, value_dim, key_axis="channel")
