"""Settings of the Palu cache."""

from __future__ import annotations

import os
from dataclasses import dataclass

from velox_core.validation import check_bits, check_choice, check_float, check_int

from .codec import check_bool
from .ranks import ALLOCATIONS

__all__ = ["PaluConfig"]


@dataclass
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
        artifact: path of the Palu artifact; None finds the one fitted for the model
            (``$VELOX_ARTIFACTS``, then ``~/.cache/velox``) when the cache is bound.
        layer: the model layer whose bases to use; ``velox_core.make_cache`` sets it.
        rope_base, rope_traditional, rope_scale, rope_dims: the RoPE of a standalone cache
            (``mlx.nn.RoPE`` settings); with a model, ``make_cache`` binds each layer's own.
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
    rope_base: float | None = None
    rope_traditional: bool = False
    rope_scale: float = 1.0
    rope_dims: int | None = None

    def __post_init__(self):
        check_float("ratio", self.ratio, minimum=0.0, maximum=1.0, open_min=True)
        for name in ("key_rank", "value_rank"):
            if getattr(self, name) is not None:
                check_int(name, getattr(self, name), minimum=1)
        check_choice("allocation", self.allocation, ALLOCATIONS)
        for name in ("bits", "key_bits", "value_bits"):
            if getattr(self, name) is not None:
                check_bits(name, getattr(self, name), 2, 8)
        if self.group is not None:
            check_int("group", self.group, minimum=1)
            if self.bits is None and self.key_bits is None and self.value_bits is None:
                raise ValueError("group (latent channels per quantization scale) needs bits")
        check_int("window", self.window, minimum=0)
        check_int("sinks", self.sinks, minimum=0)
        if self.artifact is not None:
            if not isinstance(self.artifact, (str, os.PathLike)):
                raise TypeError(f"artifact must be a path or None, got {self.artifact!r}")
            self.artifact = os.fspath(self.artifact)
        if self.layer is not None:
            check_int("layer", self.layer, minimum=0)
        check_bool("rope_traditional", self.rope_traditional)
        # rope_base / rope_scale / rope_dims are checked by the key codec
