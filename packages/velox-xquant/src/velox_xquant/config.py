"""Settings of the XQuant cache."""

from __future__ import annotations

from dataclasses import dataclass

from velox_core import CodeWidths
from velox_core.validation import (
    check_choice,
    check_counts,
    check_float,
    check_int,
    check_optional,
    check_token_groups,
    check_widths,
)

__all__ = ["SIDES", "XQuantConfig"]

SIDES = ("kv", "k", "v")  # what a layer pair shares: keys and values, keys, values


@dataclass
class XQuantConfig(CodeWidths):
    """XQuant (arXiv 2510.11236) settings, with the shared parameter names.

    Attributes:
        bits: code width of keys and values, 1 to 8 (the paper's ultra-low widths: 1 and 2).
        key_bits, value_bits: either side alone (default ``bits``).
        group: group size, KIVI's: ``group`` tokens per key channel group (keys are
            quantized per channel), ``group`` channels per value group (values per token). The
            reference code's 32 (its shared key codes are sliced as 32-token groups).
        eta: the data-free calibration, in ``[0, 0.5)``: each group's reconstruction points
            move inward by ``eta`` of its range. None: 1/6 at one bit, 0.045 at two, 0 wider
            (the middle of the reference code's grids; wider codes are not calibrated there).
        share_from: cross-layer compression: each odd layer ``l >= share_from`` stores no codes
            of its own for the shared sides and reads layer ``l - 1``'s, with its own scales
            and zero-points (the reference code's pairs ``(l - 1, l)``). None: no layer shares.
        share: the sides a pair shares: ``"kv"`` (keys and values), ``"k"`` or ``"v"``.
        window: most recent tokens kept in fp16 besides those waiting for a whole key group
            (the reference code's values keep 128; its keys 0 to 127).
        sinks: first tokens kept in fp16 (not in the paper; 0 by default).
    """

    bits: int = 2
    group: int = 32
    eta: float | None = None
    share_from: int | None = 0
    share: str = "kv"
    window: int = 128
    sinks: int = 0

    def __post_init__(self):
        check_widths(self, minimum=1, bits_required=True)
        check_int("group", self.group, minimum=1)
        if self.eta is not None:
            self.eta = check_float("eta", self.eta, minimum=0.0, maximum=0.5)
            if self.eta >= 0.5:
                raise ValueError(
                    "eta must be below 0.5 (at 0.5 both ends of a group meet at its middle), "
                    f"got {self.eta}"
                )
        check_optional(self, "share_from", minimum=0)
        check_choice("share", self.share, SIDES)
        check_counts(self, "window", "sinks")

    def shares(self, layer: int | None) -> str:
        """The sides layer ``layer`` reads from layer ``layer - 1`` ("" for none): an odd layer
        at or past ``share_from``."""
        if layer is None or self.share_from is None or layer % 2 == 0:
            return ""
        return self.share if layer >= self.share_from else ""

    def check_dims(self, key_dim: int, value_dim: int) -> None:
        """Values are quantized per token in groups of ``group`` channels, so ``group`` must
        divide the value head dim (key groups run along tokens: any key head dim works)."""
        check_token_groups("xquant", self.group, key_dim, value_dim, key_axis="channel")
