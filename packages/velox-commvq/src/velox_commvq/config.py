"""Settings of the CommVQ cache."""

from __future__ import annotations

from dataclasses import dataclass

from velox_core import CodeWidths
from velox_core.codec.prerope import check_rope_settings, rope_fields, rope_settings
from velox_core.validation import (
    check_counts,
    check_int,
    check_key_value_widths,
    check_optional,
    check_path,
)

__all__ = ["CommVQConfig"]


@dataclass
@rope_fields
class CommVQConfig(CodeWidths):
    """CommVQ (arXiv 2506.18879) settings, with the shared parameter names.

    Attributes:
        bits: bits per coordinate of keys and values (the paper: 1 and 2).
        key_bits: bits per key coordinate (default ``bits``): a whole number of the fitted
            quantizer's stages; the default codebooks reach 1 and 2.
        value_bits: bits of the values' ``velox_core.Uniform`` codes, 2 to 8 (default ``bits``;
            the paper's learned value encoder is not implemented, see docs/commvq.md).
        group: group size of the value codes (channels per fp16 scale and zero).
        window: most recent tokens kept in fp16 (0 by default).
        sinks: first tokens kept in fp16 (0 by default).
        codebooks: path of the CommVQ artifact (None: the model's, found when the cache is
            bound, :func:`~velox_commvq.artifact.resolve_codebooks`).
        layer: the model layer whose codebooks to use; ``velox_core.make_cache`` sets it.
        rope_base, rope_traditional, rope_scale, rope_dims: the RoPE of a standalone cache,
            unset with a model (:mod:`velox_core.codec.prerope`).
    """

    bits: int = 2
    group: int = 64
    window: int = 0
    sinks: int = 0
    codebooks: str | None = None
    layer: int | None = None

    def __post_init__(self):
        check_key_value_widths(self, 1, "the keys' codes")
        check_int("group", self.group, minimum=1)
        check_counts(self, "window", "sinks")
        self.codebooks = check_path("codebooks", self.codebooks)
        check_optional(self, "layer", minimum=0)
        check_rope_settings(**rope_settings(self))
