"""Settings of the SVDq cache, and the mixed-precision schedule they name."""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any

from velox_core.codec.prerope import check_rope_settings, rope_fields, rope_settings
from velox_core.validation import check_bits, check_bool, check_counts, check_int, check_optional

__all__ = ["SVDqConfig", "parse_schedule"]

FP16_VALUES = 16  # value_bits that keeps values as given (no value codec)


def parse_schedule(schedule: Any) -> tuple[int, ...]:
    """The bit widths of the equal groups of latent channels, largest singular values first.

    Accepts ``"8-4-2-1-1-0-0-0"`` (the form a spec string carries), a sequence of ints, or one
    int (every group at that width). Widths are ints in ``[0, 8]``, non-increasing (precision
    falls with the singular value), with at least one above 0; a 0-bit group is dropped.

    Raises:
        TypeError / ValueError: naming ``schedule`` and what is allowed.
    """
    if isinstance(schedule, bool):
        raise TypeError(f"schedule must be a '-'-joined string of bit widths, got {schedule!r}")
    if isinstance(schedule, int):
        parts: list[Any] = [schedule]
    elif isinstance(schedule, str):
        parts = [p.strip() for p in schedule.split("-")]
        try:
            parts = [int(p) for p in parts]
        except ValueError:
            raise ValueError(
                f"schedule must be bit widths joined by '-', e.g. '8-4-2-1-1-0-0-0'; got "
                f"{schedule!r}"
            ) from None
    elif isinstance(schedule, (list, tuple)):
        parts = list(schedule)
    else:
        raise TypeError(
            f"schedule must be a string like '8-4-2-1-1-0-0-0', a sequence of ints or an int; "
            f"got {type(schedule).__name__} {schedule!r}"
        )
    if not parts:
        raise ValueError("schedule must name at least one group")
    widths = tuple(check_bits(f"schedule[{i}]", w, 0, 8) for i, w in enumerate(parts))
    if any(a < b for a, b in itertools.pairwise(widths)):
        raise ValueError(
            f"schedule must not increase (groups of smaller singular values get no more bits): "
            f"got {'-'.join(map(str, widths))}"
        )
    if widths[0] == 0:
        raise ValueError("schedule must give at least its first group more than 0 bits")
    return widths


def format_schedule(widths: tuple[int, ...]) -> str:
    return "-".join(map(str, widths))


@dataclass
@rope_fields
class SVDqConfig:
    """SVDq (arXiv 2502.15304) settings, with the shared parameter names.

    Attributes:
        schedule: bit widths of the equal groups the ``D`` latent channels are split into,
            largest singular values first (the paper: 8 groups, e.g. ``"8-4-2-1-1-0-0-0"``,
            2 bits per channel on average); 0-bit groups are dropped. ``D`` must be a multiple
            of the number of groups.
        rank: latent channels kept (the first ``rank``; None: every channel of a group above
            0 bits). Must not exceed what the schedule codes.
        group: tokens per per-channel key scale block (the latent codes are quantized per
            channel over ``group`` tokens), and channels per value group.
        value_bits: width of the per-token ``velox_core.Uniform`` value codes (2 to 8), or 16
            to keep values in fp16 (the paper compresses keys only).
        calibration: tokens (after the sinks) the cache gathers in fp16 before fitting the
            basis on them (a prefill that arrives whole fits on all of it); later tokens are
            projected onto that basis.
        center: subtract the calibration tokens' mean key before the SVD (not in the paper).
        window: most recent tokens kept in fp16 (0 by default).
        sinks: first tokens kept in fp16 (0 by default).
        pre_rope: fit and code keys before RoPE (as the paper does); False codes post-RoPE keys.
        rope_base, rope_traditional, rope_scale, rope_dims: the RoPE of a standalone cache,
            unset with a model (:mod:`velox_core.codec.prerope`).
    """

    schedule: str = "8-4-2-1-1-0-0-0"
    rank: int | None = None
    group: int = 64
    value_bits: int = 4
    calibration: int = 512
    center: bool = False
    window: int = 0
    sinks: int = 0
    pre_rope: bool = True

    def __post_init__(self):
        self.schedule = format_schedule(parse_schedule(self.schedule))
        check_optional(self, "rank")
        check_int("group", self.group, minimum=1)
        if self.value_bits != FP16_VALUES:
            try:
                check_bits("value_bits", self.value_bits, 2, 8)
            except ValueError:
                raise ValueError(
                    f"value_bits must be 2 to 8 or {FP16_VALUES} (fp16), got {self.value_bits}"
                ) from None
        check_int("calibration", self.calibration, minimum=1)
        check_bool("center", self.center)
        check_counts(self, "window", "sinks")
        check_rope_settings(**rope_settings(self))
