"""Settings of the KVarN cache."""

from __future__ import annotations

from dataclasses import dataclass

from velox_core import CodeWidths
from velox_core.validation import check_counts, check_int, check_optional, check_widths

from .codec import MAX_ITERS


@dataclass
class KVarNConfig(CodeWidths):
    """KVarN (arXiv 2606.03458) settings, with the shared parameter names.

    Attributes:
        bits: code width of keys and values, 2 to 8.
        key_bits, value_bits: either side alone (default ``bits``); the paper's headline
            setting is ``key_bits=4, value_bits=2``.
        group: tokens per tile (the authors' 128, or 64); each tile is normalized and
            rounded on its own, and keeps ``2 D + group`` fp16 scales a side.
        iters: normalization iterations per tile, 0 to 64 (the authors' system runs 8).
        window: newest tokens kept in fp16 besides the tile being filled (0: only that tile,
            as the authors' tail).
        sinks: first tokens kept in fp16 (the authors' 128).
        seed: None for the Sylvester Hadamard rotation (the paper's), or the seed of a
            randomized Hadamard rotation.
    """

    bits: int = 4
    group: int = 128
    iters: int = 8
    window: int = 0
    sinks: int = 128
    seed: int | None = None

    def __post_init__(self):
        check_widths(self, bits_required=True)
        check_int("group", self.group, minimum=2)
        check_int("iters", self.iters, minimum=0, maximum=MAX_ITERS)
        check_counts(self, "window", "sinks")
        check_optional(self, "seed", minimum=0)

    def check_dims(self, key_dim: int, value_dim: int) -> None:
        """The channels are rotated by (block-)Hadamard transforms: both head dims must be
        even (any even head dim works, tiles run along tokens)."""
        for side, dim in (("key", key_dim), ("value", value_dim)):
            if dim % 2:
                raise ValueError(
                    f"kvarn: {side} head dim {dim} is odd: the Hadamard rotation of its "
                    "channels needs an even head dim"
                )
