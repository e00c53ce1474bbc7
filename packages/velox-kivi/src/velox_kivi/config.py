"""Settings of the KIVI cache."""

from __future__ import annotations

from dataclasses import dataclass

from velox_core import CodeWidths
from velox_core.validation import check_counts, check_int, check_token_groups, check_widths


@dataclass
class KIVIConfig(CodeWidths):
    """KIVI (arXiv 2402.02750) settings, with the shared parameter names.

    Attributes:
        bits: code width of keys and values (the paper studies 2 and 4).
        key_bits, value_bits: either alone (default ``bits``).
        group: group size: ``group`` tokens per key channel group, ``group`` channels per
            value group.
        window: the residual: most recent tokens kept in fp16 (the paper's ``R``).
        sinks: first tokens kept in fp16 (not in the paper; 0 by default).
    """

    group: int = 32
    window: int = 128
    sinks: int = 0

    def __post_init__(self):
        check_widths(self, bits_required=True)
        check_int("group", self.group, minimum=1)
        check_counts(self, "window", "sinks")

    def check_dims(self, key_dim: int, value_dim: int) -> None:
        """Values are quantized per token in groups of ``group`` channels, so ``group`` must
        divide the value head dim (key groups run along tokens: any key head dim works)."""
        check_token_groups("kivi", self.group, key_dim, value_dim, key_axis="channel")
