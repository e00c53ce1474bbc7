"""``UniformCache``: keys and values as ``Uniform`` affine codes (velox-core's own method)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..codec.uniform import Uniform
from ..ops.quant import AXES
from ..validation import (
    check_choice,
    check_counts,
    check_float,
    check_int,
    check_token_groups,
    check_widths,
)
from .preset import PresetCache, resolve_bits

__all__: list[str] = []


@dataclass
class UniformConfig:
    """Settings of :class:`UniformCache` (shared parameter names, see the design)."""

    bits: int = 4
    key_bits: int | None = None
    value_bits: int | None = None
    group: int = 64
    key_axis: str = "token"
    value_axis: str = "token"
    clip: float = 1.0
    window: int = 0
    sinks: int = 0

    def __post_init__(self):
        check_widths(self, bits_required=True)
        check_int("group", self.group, minimum=1)
        check_choice("key_axis", self.key_axis, AXES)
        check_choice("value_axis", self.value_axis, AXES)
        check_float("clip", self.clip, minimum=0.0, maximum=1.0, open_min=True)
        check_counts(self, "window", "sinks")

    def check_dims(self, key_dim: int, value_dim: int) -> None:
        """Per-token groups split a token's channels: ``group`` must divide that head dim."""
        check_token_groups(
            "uniform", self.group, key_dim, value_dim, self.key_axis, self.value_axis
        )


class UniformCache(PresetCache):
    """Affine per-group codes for keys and values (``mx.quantize``-like, but packed by us,
    attended from the codes, with optional fp16 sinks and window)."""

    method = "uniform"
    Config = UniformConfig

    def build(self, cfg: UniformConfig) -> dict[str, Any]:
        kb, vb = resolve_bits(cfg.bits, cfg.key_bits, cfg.value_bits)
        return {
            "key_codec": Uniform(kb, cfg.group, cfg.key_axis, cfg.clip),
            "value_codec": Uniform(vb, cfg.group, cfg.value_axis, cfg.clip),
        }
