"""Settings of the GEAR cache."""

from __future__ import annotations

from dataclasses import dataclass

from velox_core import CodeWidths
from velox_core.validation import check_counts, check_float, check_int, check_widths

_INDEX_LIMIT = 1 << 16


@dataclass
class GearConfig(CodeWidths):
    """GEAR (arXiv 2403.05527) settings, with the shared parameter names.

    Attributes:
        bits: backbone code width of keys and values (the paper: 2 and 4).
        key_bits, value_bits: either side alone (default ``bits``).
        group: the streaming buffer ``n_b`` (tokens coded together: a block), the tokens of
            a key channel group and the channels of a value token group (the authors'
            scripts: 64 for all three).
        rank: rank of the residual's approximation per block and KV head (the paper: 4).
        outliers: fraction of each block's entries kept exactly as sparse outliers, half the
            largest and half the smallest (the paper's ``s``: 2%).
        iters: power iterations of the low-rank solver (the authors' scripts: 3).
        window: most recent tokens kept in fp16 beyond the partial block (GEAR: 0).
        sinks: first tokens kept in fp16 (GEAR: 0).
        seed: the random start of the power iterations.
    """

    bits: int = 2
    group: int = 64
    rank: int = 4
    outliers: float = 0.02
    iters: int = 3
    window: int = 0
    sinks: int = 0
    seed: int = 0

    def __post_init__(self):
        check_widths(self, bits_required=True)
        check_int("group", self.group, minimum=1)
        check_int("rank", self.rank, minimum=0)
        if self.rank > self.group:
            raise ValueError(f"gear: rank={self.rank} exceeds group={self.group} (tokens a block)")
        check_float("outliers", self.outliers, minimum=0.0, maximum=0.5)
        check_int("iters", self.iters, minimum=1)
        check_int("seed", self.seed, minimum=0)
        check_counts(self, "window", "sinks")

    def check_dims(self, key_dim: int, value_dim: int) -> None:
        """Values are quantized per token in groups of ``group`` channels (``group`` divides
        the value head dim); ``rank`` is at most the head dim; a block's ``group * D``
        entries are addressed by uint16 outlier indices."""
        if value_dim % self.group:
            raise ValueError(
                f"gear: group={self.group} must divide the value head dim {value_dim} "
                "(values are quantized per token in groups of `group` channels)"
            )
        for side, dim in (("key", key_dim), ("value", value_dim)):
            if self.rank > dim:
                raise ValueError(f"gear: rank={self.rank} exceeds the {side} head dim {dim}")
            if self.group * dim > _INDEX_LIMIT:
                raise ValueError(
                    f"gear: group={self.group} x {side} head dim {dim} exceeds {_INDEX_LIMIT} "
                    "entries a block (outlier indices are uint16)"
                )
