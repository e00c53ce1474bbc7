"""Settings of the RaBitQ cache."""

from __future__ import annotations

from dataclasses import dataclass

from velox_core import CodeWidths
from velox_core.validation import check_counts, check_int, check_key_value_widths

__all__ = ["RaBitQConfig"]


@dataclass
class RaBitQConfig(CodeWidths):
    """RaBitQ (arXiv 2405.12497, 2409.09913) settings, with the shared parameter names.

    Keys are RaBitQ codes (1 bit per coordinate: the sign code; 2 to 8 bits: the extended
    code); values are quantized per token by ``velox_core.Uniform``.

    Attributes:
        bits: ``key_bits`` and ``value_bits`` together (1 is allowed only with ``value_bits``,
            since values need 2 bits at least).
        key_bits: bits per key coordinate, 1 to 8 (default ``bits``).
        value_bits: value code width, 2 to 8 (default ``bits``).
        group: channels per value group (``velox_core.Uniform``; must divide the head dim).
        centroid: tokens per key centroid block (their mean is the centroid RaBitQ codes the
            keys against, as the papers normalize against each IVF cluster's centroid); 0 uses
            the zero centroid and codes every key alone.
        rounds: rounds of the randomized Hadamard key rotation (1 to 8; 2 by default, see
            :mod:`velox_rabitq.rotation`).
        window: most recent tokens kept in fp16 (not in the papers; 0 by default).
        sinks: first tokens kept in fp16 (not in the papers; 0 by default).
        seed: seed of the key rotation.
    """

    group: int = 64
    centroid: int = 128
    rounds: int = 2
    window: int = 0
    sinks: int = 0
    seed: int = 0

    def __post_init__(self):
        check_key_value_widths(self, 1, "the keys' sign code")
        check_int("group", self.group, minimum=1)
        check_int("rounds", self.rounds, minimum=1, maximum=8)
        check_counts(self, "centroid", "window", "sinks", "seed")
