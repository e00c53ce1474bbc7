"""Settings of the NSNQuant cache."""

from __future__ import annotations

from dataclasses import dataclass

from velox_core import CodeWidths
from velox_core.validation import check_counts, check_int, check_optional, check_widths

__all__ = ["NSNQuantConfig"]


@dataclass
class NSNQuantConfig(CodeWidths):
    """NSNQuant (arXiv 2505.18231) settings, with the shared parameter names.

    Attributes:
        bits: bits an entry of keys and values, 1 to 8 (the paper's settings: 1 and 2).
        key_bits, value_bits: either side alone (default ``bits``).
        group: tokens per block: the shift is the mean of a block's normalized tokens, and a
            block keeps its rotated shift (``D`` fp16 numbers) beside its codes.
        window: newest tokens kept in fp16 besides the block being filled.
        sinks: first tokens kept in fp16.
        seed: None for the Sylvester Hadamard rotation (the paper's Hadamard transform), or
            the seed of a randomized Hadamard rotation.
    """

    bits: int = 2
    group: int = 128
    window: int = 0
    sinks: int = 0
    seed: int | None = None

    def __post_init__(self):
        check_widths(self, minimum=1, bits_required=True)
        check_int("group", self.group, minimum=1)
        check_counts(self, "window", "sinks")
        check_optional(self, "seed", minimum=0)

    def check_dims(self, key_dim: int, value_dim: int) -> None:
        """The channels are rotated by (block-)Hadamard transforms: both head dims must be
        even."""
        for side, dim in (("key", key_dim), ("value", value_dim)):
            if dim % 2:
                raise ValueError(
                    f"nsnquant: {side} head dim {dim} is odd: the Hadamard rotation of its "
                    "channels needs an even head dim"
                )
