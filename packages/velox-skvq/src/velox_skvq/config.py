"""Settings of the SKVQ cache."""

from __future__ import annotations

from dataclasses import dataclass

from velox_core import CodeWidths
from velox_core.validation import (
    check_bool,
    check_counts,
    check_divides,
    check_float,
    check_int,
    check_optional,
    check_widths,
)

__all__ = ["SKVQConfig", "check_bits"]

TERNARY = 1.5


def check_bits(name: str, value) -> int | float:
    """SKVQ code widths: an int from 2 to 8, or 1.5 (three levels, the paper's 1.5-bit values).

    An integral float (``2.0``) is taken as the int.
    """
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be 1.5 or an int from 2 to 8, got {value!r}")
    if value == TERNARY:
        return TERNARY
    if float(value).is_integer() and 2 <= value <= 8:
        return int(value)
    raise ValueError(f"{name} must be 1.5 or an int from 2 to 8, got {value!r}")


@dataclass
class SKVQConfig(CodeWidths):
    """SKVQ (arXiv 2405.06219) settings, with the shared parameter names.

    Attributes:
        bits: code width of keys and values: 2 to 8, or 1.5 (ternary codes, three levels).
        key_bits, value_bits: either alone (default ``bits``); the paper's headline setting
            is ``key_bits=2, value_bits=1.5``.
        group: channels per quantization group, after reordering; must divide the head dim.
        key_group, value_group: either alone (default ``group``): keys, whose outlier
            channels cost most, may take smaller groups than values.
        window: most recent tokens kept in fp16 (the sliding window).
        sinks: first tokens kept in fp16 (attention sinks; the reference code keeps 5).
        clip_min: smallest clipping factor searched; the grid runs from 1.0 down to it in
            steps of about 0.02 (``clip_min=1.0`` turns clipping off).
        reorder: reorder channels (True) or keep the model's channel order (ablation).
    """

    bits: int | float = 2
    group: int = 64
    key_group: int | None = None
    value_group: int | None = None
    window: int = 128
    sinks: int = 5
    clip_min: float = 0.7
    reorder: bool = True

    def __post_init__(self):
        check_widths(self, check=check_bits, bits_required=True)
        check_int("group", self.group, minimum=1)
        check_optional(self, "key_group", "value_group")
        check_counts(self, "window", "sinks")
        self.clip_min = check_float("clip_min", self.clip_min, minimum=0.5, maximum=1.0)
        check_bool("reorder", self.reorder)

    def check_dims(self, key_dim: int, value_dim: int) -> None:
        """Each token's (reordered) channels are split into groups: the key group must divide
        the key head dim, the value group the value head dim."""
        for side, own, dim in (
            ("key", self.key_group, key_dim),
            ("value", self.value_group, value_dim),
        ):
            name, group = (f"{side}_group", own) if own is not None else ("group", self.group)
            check_divides(
                "skvq",
                name,
                group,
                dim,
                f"{side} head dim",
                f"each token's reordered {side} channels are quantized in groups of {name}",
            )
