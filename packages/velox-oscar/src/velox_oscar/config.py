"""Settings of the OSCAR cache."""

from __future__ import annotations

from dataclasses import dataclass

from velox_core import CodeWidths
from velox_core.validation import (
    check_bool,
    check_choice,
    check_counts,
    check_float,
    check_int,
    check_optional,
    check_path,
    check_widths,
)

from .codec import BASES, check_head_dim

__all__ = ["CHANNEL_GROUP", "KEYS", "OscarConfig"]

KEYS = ("oscar", "channel")  # OSCAR's rotated per-token keys (the paper), KIVI's per-channel
CHANNEL_GROUP = 128  # keys="channel": tokens per key channel group (KIVI's group=128)


@dataclass
class OscarConfig(CodeWidths):
    """OSCAR (arXiv 2605.17757) settings, with the shared parameter names.

    Attributes:
        bits: code width of keys and values (the paper: 2, INT2).
        key_bits, value_bits: either side alone (default ``bits``).
        group: channels per fp16 scale and minimum along the head dim (None: the whole head,
            at most 128, the paper's group).
        window: most recent tokens kept exact (the paper's recent window: 256).
        sinks: first tokens kept exact (the paper's sink: 64).
        key_clip, value_clip: the clip ratio of each side (a row's threshold is its absolute
            value of rank ``int(clip * D)``; 1 clips nothing); None: the ratio fitted per
            layer in the artifact.
        rotation: ``"oscar"`` (the fitted ``U H P_br`` of each layer) or ``"hadamard"`` (the
            Sylvester Hadamard matrix alone, the paper's ablation; with both clips given it
            needs no artifact).
        artifact: path of the OSCAR artifact (None: the model's, found when the cache is
            bound, :func:`~velox_oscar.artifact.resolve_rotations`).
        layer: the model layer whose rotations to use; ``velox_core.make_cache`` sets it.
        centre: code each key less its KV head's mean key, fitted with the rotations (the
            artifact's ``key_mean``), with the clip ratio fitted for centred keys; exact for
            attention (a shift common to every key moves a query's logits alike), and not in
            the paper (docs/oscar.md). Values are coded as they are.
        keys: ``"oscar"`` (the paper: keys rotated, clipped and coded per token) or
            ``"channel"`` (not in the paper: keys coded per channel as KIVI codes them,
            ``velox_core.Uniform(key_bits, key_group, axis="channel")``, unrotated and
            unclipped, beside OSCAR's rotated values; docs/oscar.md, *Per-channel keys*).
        key_group: with ``keys="channel"``, tokens per key channel group, each with an fp16
            scale and minimum (None: 128, KIVI's ``group=128``); tokens leave the window in
            whole groups.
    """

    bits: int = 2
    group: int | None = None
    window: int = 256
    sinks: int = 64
    key_clip: float | None = None
    value_clip: float | None = None
    rotation: str = "oscar"
    artifact: str | None = None
    layer: int | None = None
    centre: bool = False
    keys: str = "oscar"
    key_group: int | None = None

    def __post_init__(self):
        check_widths(self, bits_required=True)
        if self.group is not None:
            check_int("group", self.group, minimum=1)
        check_counts(self, "window", "sinks")
        for name in ("key_clip", "value_clip"):
            value = getattr(self, name)
            if value is not None:
                ratio = check_float(name, value, minimum=0.0, maximum=1.0, open_min=True)
                setattr(self, name, ratio)
        check_choice("rotation", self.rotation, BASES)
        self.artifact = check_path("artifact", self.artifact)
        check_optional(self, "layer", minimum=0)
        self.centre = check_bool("centre", self.centre)
        check_choice("keys", self.keys, KEYS)
        if self.key_group is not None:
            if self.keys != "channel":
                raise ValueError(
                    'key_group applies to keys="channel" only (OSCAR\'s per-token keys are '
                    "grouped along the head dim by `group`)"
                )
            check_int("key_group", self.key_group, minimum=1)
        if self.keys == "channel":
            for name in ("key_clip", "centre"):
                if getattr(self, name) not in (None, False):
                    raise ValueError(
                        f'{name} applies to OSCAR\'s rotated per-token keys only; keys="channel" '
                        "codes the keys per channel, unrotated and unclipped"
                    )

    @property
    def channel_group(self) -> int:
        """Tokens per key channel group of ``keys="channel"`` (``key_group``, default 128)."""
        return CHANNEL_GROUP if self.key_group is None else self.key_group

    @property
    def needs_artifact(self) -> bool:
        """Whether the caches read a fitted artifact (rotations, clip ratios or key means)."""
        if self.keys == "channel":  # the keys need nothing fitted
            return self.rotation == "oscar" or self.value_clip is None
        return (
            self.rotation == "oscar"
            or self.key_clip is None
            or self.value_clip is None
            or self.centre
        )

    def check_dims(self, key_dim: int, value_dim: int) -> None:
        """The head dims the rotation and the groups take (``oscar: ... head dim D ...``)."""
        if self.keys == "oscar":  # per-channel keys take any head dim (groups run along tokens)
            check_head_dim("oscar", self.rotation, self.group, key_dim, "key")
        check_head_dim("oscar", self.rotation, self.group, value_dim, "value")
