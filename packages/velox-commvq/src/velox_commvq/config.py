"""Settings of the CommVQ cache."""

from __future__ import annotations

import os
from dataclasses import dataclass

from velox_core.validation import check_bits, check_int

from .codec import check_bool

__all__ = ["CommVQConfig"]


@dataclass
class CommVQConfig:
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
        codebooks: path of the CommVQ artifact; None finds the one fitted for the model
            (``$VELOX_ARTIFACTS``, then ``~/.cache/velox``) when the cache is bound.
        layer: the model layer whose codebooks to use; ``velox_core.make_cache`` sets it.
        rope_base, rope_traditional, rope_scale, rope_dims: the RoPE of a standalone cache
            (``mlx.nn.RoPE`` settings). Leave ``rope_base`` unset with a model:
            ``make_cache`` binds each layer's own RoPE.
    """

    bits: int = 2
    key_bits: int | None = None
    value_bits: int | None = None
    group: int = 64
    window: int = 0
    sinks: int = 0
    codebooks: str | None = None
    layer: int | None = None
    rope_base: float | None = None
    rope_traditional: bool = False
    rope_scale: float = 1.0
    rope_dims: int | None = None

    def __post_init__(self):
        check_bits("bits", self.bits, 1, 8)
        if self.key_bits is not None:
            check_bits("key_bits", self.key_bits, 1, 8)
        if self.value_bits is not None:
            check_bits("value_bits", self.value_bits, 2, 8)
        elif self.bits < 2:
            raise ValueError(
                f"bits={self.bits} would give the values {self.bits}-bit Uniform codes (2 to 8); "
                "set value_bits, e.g. key_bits=1, value_bits=4"
            )
        check_int("group", self.group, minimum=1)
        check_int("window", self.window, minimum=0)
        check_int("sinks", self.sinks, minimum=0)
        if self.codebooks is not None:
            if not isinstance(self.codebooks, (str, os.PathLike)):
                raise TypeError(f"codebooks must be a path or None, got {self.codebooks!r}")
            self.codebooks = os.fspath(self.codebooks)
        if self.layer is not None:
            check_int("layer", self.layer, minimum=0)
        check_bool("rope_traditional", self.rope_traditional)
        # rope_base / rope_scale / rope_dims are checked by the key codec
