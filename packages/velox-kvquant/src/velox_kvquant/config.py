"""Settings of the KVQuant cache."""

from __future__ import annotations

from dataclasses import dataclass

from velox_core import CodeWidths
from velox_core.codec.prerope import check_rope_settings, rope_fields, rope_settings
from velox_core.validation import (
    check_bool,
    check_choice,
    check_counts,
    check_float,
    check_int,
    check_widths,
)

from .nuq import DATATYPES


@dataclass
@rope_fields
class KVQuantConfig(CodeWidths):
    """KVQuant (arXiv 2401.18079) settings, with the shared parameter names.

    Attributes:
        bits: code width of keys and values (the paper: 2, 3 and 4; 2 to 8 allowed).
        key_bits, value_bits: either alone (default ``bits``).
        outliers: fraction of each key and value vector kept exactly in fp16 (dense-and-sparse;
            ``round(outliers * D)`` entries per vector, at least one; 0 turns it off).
        sinks: first tokens kept in fp16 (attention-sink-aware quantization: the paper keeps 1).
        window: most recent tokens kept in fp16 (not in the paper; 0 by default).
        calibration: tokens (after the sinks) the cache gathers in fp16 before fitting the
            per-channel key scales and both datatypes on them, and coding from then on.
        datatype: ``"nuq"`` (the paper's fitted non-uniform levels) or ``"uniform"`` (evenly
            spaced levels on the same normalization: the paper's ``intX`` ablation).
        qnorm: Q-Norm the fitted levels (the paper's refinement for 2 bits).
        pre_rope: quantize keys before RoPE (the paper); False codes the post-RoPE keys.
        rope_base, rope_traditional, rope_scale, rope_dims: the RoPE of a standalone cache,
            unset with a model (:mod:`velox_core.codec.prerope`).
    """

    outliers: float = 0.01
    sinks: int = 1
    window: int = 0
    calibration: int = 128
    datatype: str = "nuq"
    qnorm: bool = False
    pre_rope: bool = True

    def __post_init__(self):
        check_widths(self, bits_required=True)
        check_float("outliers", self.outliers, minimum=0.0, maximum=0.5)
        check_counts(self, "sinks", "window")
        check_int("calibration", self.calibration, minimum=1)
        check_choice("datatype", self.datatype, DATATYPES)
        check_bool("qnorm", self.qnorm)
        check_rope_settings(**rope_settings(self))
