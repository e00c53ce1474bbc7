"""Settings of the AgeTiered cache, and the token layout they imply at a given context length."""

from __future__ import annotations

from dataclasses import dataclass

from velox_core.ops.quant import AXES
from velox_core.validation import (
    check_bits,
    check_choice,
    check_counts,
    check_int,
    check_token_groups,
)

__all__ = ["AgeTieredConfig"]


@dataclass
class AgeTieredConfig:
    """AgeTiered settings: three precision tiers by token age, newest first.

    Ages run back from the newest token: the first ``sinks`` tokens and the ``window`` newest
    stay as given (fp16); the next ``recent`` tokens are coded at ``recent_bits``, the
    ``middle`` tokens before them at ``middle_bits``, and every older token at ``old_bits``.
    The defaults are the ~4-bit recommended setting (8/6/3 bits, boundaries at ages 64 and
    1,280): nested widths, so re-coding loses nothing beyond direct coding (docs/agetiered.md).

    Attributes:
        recent_bits: code width of the recent tier (2 to 8).
        middle_bits: code width of the middle tier (2 to 8, at most ``recent_bits``).
        old_bits: code width of the oldest tier (2 to 8, at most ``middle_bits``).
        recent: tokens held in the recent tier (the first boundary is at age
            ``window + recent``).
        middle: tokens held in the middle tier (the second boundary is at age
            ``window + recent + middle``).
        group: group size of the affine codes: tokens per key group with
            ``key_axis="channel"``, channels per group with ``"token"`` (same for values).
        key_axis, value_axis: ``"channel"`` (per-channel groups, coded ``group`` tokens at a
            time) or ``"token"`` (per-token groups).
        window: newest tokens kept in fp16 (block codecs keep up to ``group - 1`` more until a
            whole group is ready).
        sinks: first tokens kept in fp16 (attention sinks).
    """

    recent_bits: int = 8
    middle_bits: int = 6
    old_bits: int = 3
    recent: int = 64
    middle: int = 1216
    group: int = 64
    key_axis: str = "channel"
    value_axis: str = "token"
    window: int = 0
    sinks: int = 0

    def __post_init__(self):
        for name in ("recent_bits", "middle_bits", "old_bits"):
            check_bits(name, getattr(self, name), 2, 8)
        if self.middle_bits > self.recent_bits:
            raise ValueError(
                f"middle_bits must be <= recent_bits={self.recent_bits} (precision never rises "
                f"with age); got {self.middle_bits}"
            )
        if self.old_bits > self.middle_bits:
            raise ValueError(
                f"old_bits must be <= middle_bits={self.middle_bits} (precision never rises "
                f"with age); got {self.old_bits}"
            )
        check_int("group", self.group, minimum=1)
        check_choice("key_axis", self.key_axis, AXES)
        check_choice("value_axis", self.value_axis, AXES)
        for name in ("recent", "middle"):
            span = check_int(name, getattr(self, name), minimum=1)
            if span % self.block:
                raise ValueError(
                    f"{name} must be a multiple of group={self.group} when an axis is "
                    f"'channel' (tokens move between tiers in whole groups); got {span}"
                )
        check_counts(self, "window", "sinks")

    def check_dims(self, key_dim: int, value_dim: int) -> None:
        """A side with per-token groups (``axis="token"``) splits each token's channels into
        groups of ``group``, which must divide that head dim."""
        axes = (self.key_axis, self.value_axis)
        check_token_groups("agetiered", self.group, key_dim, value_dim, *axes)

    @property
    def block(self) -> int:
        """Tokens coded together: ``group`` when keys or values use per-channel groups."""
        return self.group if "channel" in (self.key_axis, self.value_axis) else 1

    def layout(self, tokens: int) -> dict[str, int]:
        """Tokens held by each segment once ``tokens`` tokens have been stored.

        The cache moves tokens out of the window in whole blocks, so this is exact for any
        chunking of the input: ``{"sinks", "recent", "middle", "old", "window"}``.
        """
        check_int("tokens", tokens, minimum=0)
        sinks = min(self.sinks, tokens)
        rest = tokens - sinks
        coded = max(rest - self.window, 0) // self.block * self.block
        recent = min(coded, self.recent)
        middle = min(coded - recent, self.middle)
        return {
            "sinks": sinks,
            "old": coded - recent - middle,
            "middle": middle,
            "recent": recent,
            "window": rest - coded,
        }

    def average_bits(self, tokens: int) -> float:
        """Code bits per element averaged over a ``tokens``-token context (fp16 counts 16).

        Nominal: scales and zeros (``32 / group`` bits per element) come on top, and resident
        memory is measured by ``cache.nbytes``, not by this.
        """
        n = self.layout(tokens)
        bits = {
            "sinks": 16,
            "window": 16,
            "recent": self.recent_bits,
            "middle": self.middle_bits,
            "old": self.old_bits,
        }
        return sum(n[k] * bits[k] for k in n) / max(tokens, 1)
