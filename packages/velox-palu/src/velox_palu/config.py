"""Settings of the Palu cache."""

from __future__ import annotations

from dataclasses import dataclass

from velox_core.codec.prerope import check_rope_settings, rope_fields, rope_settings
from velox_core.validation import (
    check_choice,
    check_counts,
    check_float,
    check_int,
    check_optional,
    check_path,
    check_widths,
)

from .ranks import ALLOCATIONS

__all__ = ["PaluConfig"]


@dataclass
@rope_fields
class PaluConfig:
    """Palu (arXiv 2407.21118) settings, with the shared parameter names.

    Attributes:
        ratio: kept fraction of the model's key and value dimensions (Palu's
            ``param_ratio_target``; 0.5 halves the fp16 cache), allocated over layers.
        key_rank, value_rank: latent dimensions per head group, the same in every layer
            (override ``ratio`` for that side; multiples of the heads per group).
        allocation: ``"fisher"`` (Palu's Fisher-information rank search) or ``"uniform"``.
        bits: quantize the latents of keys and values to this many bits after a Hadamard
            rotation (None: fp16 latents, Palu without quantization).
        key_bits, value_bits: either side alone (default ``bits``).
        group: latent channels per quantization scale and zero (None: a head's whole share of
            its group's latent, per token); needs bits.
        window: most recent tokens kept in fp16 (0 by default).
        sinks: first tokens kept in fp16 (0 by default).
        artifact: path of the Palu artifact (None: the model's, found when the cache is
            bound, :func:`~velox_palu.artifact.resolve_bases`).
        layer: the model layer whose bases to use; ``velox_core.make_cache`` sets it.
        rope_base, rope_traditional, rope_scale, rope_dims: the RoPE of a standalone cache,
            unset with a model (:mod:`velox_core.codec.prerope`).
    """

    ratio: float = 0.5
    key_rank: int | None = None
    value_rank: int | None = None
    allocation: str = "fisher"
    bits: int | None = None
    key_bits: int | None = None
    value_bits: int | None = None
    group: int | None = None
    window: int = 0
    sinks: int = 0
    artifact: str | None = None
    layer: int | None = None

    def __post_init__(self):
        check_float("ratio", self.ratio, minimum=0.0, maximum=1.0, open_min=True)
        check_optional(self, "key_rank", "value_rank")
        check_choice("allocation", self.allocation, ALLOCATIONS)
        check_widths(self)
        if self.group is not None:
            check_int("group", self.group, minimum=1)
            if self.bits is None and self.key_bits is None and self.value_bits is None:
                raise ValueError("group (latent channels per quantization scale) needs bits")
        check_counts(self, "window", "sinks")
        self.artifact = check_path("artifact", self.artifact)
        check_optional(self, "layer", minimum=0)
        check_rope_settings(**rope_settings(self))
