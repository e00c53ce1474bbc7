"""Settings of the QJL cache."""

from __future__ import annotations

from dataclasses import dataclass

from velox_core import CodeWidths
from velox_core.validation import (
    check_bool,
    check_counts,
    check_int,
    check_key_value_widths,
    check_optional,
    check_token_groups,
)


@dataclass
class QJLConfig(CodeWidths):
    """QJL (arXiv 2406.03482) settings, with the shared parameter names.

    Keys are 1-bit sign sketches, so a key "bit width" is the sketch size per channel:
    ``m = key_bits * head_dim`` sign bits per key (the paper's code: ``m = 256`` at head dim
    128, i.e. ``key_bits = 2``). Values are quantized per token by ``velox_core.Uniform``.

    Attributes:
        bits: ``key_bits`` and ``value_bits`` together (1 is allowed only with ``value_bits``).
        key_bits: sign bits per key channel of the main sketch (1 to 8; default ``bits``).
        value_bits: value code width, 2 to 8 (default ``bits``).
        sketch: the main sketch size ``m`` in bits, instead of ``key_bits``.
        outliers: outlier channels per block of ``group`` tokens (0 turns outlier handling
            off; None: ``head_dim // 16``, i.e. 8 at 128 as in the paper's code).
        outlier_bits: sign bits per outlier channel (``m_o = outlier_bits * outliers``).
        group: channels per value group, and tokens per outlier block.
        orthogonal: orthogonalize the rows of the projection (Section 4.1).
        window: most recent tokens kept in fp16 (the paper's code: a 128-token buffer).
        sinks: first tokens kept in fp16 (not in the paper; 0 by default).
        seed: seed of the projection.
    """

    bits: int = 2
    sketch: int | None = None
    outliers: int | None = None
    outlier_bits: int = 32
    group: int = 32
    orthogonal: bool = True
    window: int = 128
    sinks: int = 0
    seed: int = 0

    def __post_init__(self):
        check_key_value_widths(self, 1, "the key sketch")
        if self.sketch is not None:
            check_int("sketch", self.sketch, minimum=1)
            if self.key_bits is not None:
                raise ValueError(
                    "pass either key_bits (sketch = key_bits x head dim) or sketch (sign bits "
                    "per key), not both"
                )
        check_optional(self, "outliers", minimum=0)
        check_int("outlier_bits", self.outlier_bits, minimum=1)
        check_int("group", self.group, minimum=1)
        check_bool("orthogonal", self.orthogonal)
        check_counts(self, "window", "sinks", "seed")

    def check_dims(self, key_dim: int, value_dim: int) -> None:
        """Values are quantized per token in groups of ``group`` channels, so ``group`` must
        divide the value head dim (the key sketch takes any head dim; the QJL codec checks
        its outlier count)."""
        check_token_groups("qjl", self.group, key_dim, value_dim, key_axis=None)
