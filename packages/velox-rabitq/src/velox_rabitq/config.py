"""Settings of the RaBitQ cache."""

from __future__ import annotations

from dataclasses import dataclass

from velox_core.validation import check_bits, check_int

__all__ = ["RaBitQConfig"]


@dataclass
class RaBitQConfig:
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

    bits: int = 4
    key_bits: int | None = None
    value_bits: int | None = None
    group: int = 64
    centroid: int = 128
    rounds: int = 2
    window: int = 0
    sinks: int = 0
    seed: int = 0

    def __post_init__(self):
        check_bits("bits", self.bits, 1, 8)
        if self.key_bits is not None:
            check_bits("key_bits", self.key_bits, 1, 8)
        if self.value_bits is not None:
            check_bits("value_bits", self.value_bits, 2, 8)
        elif self.bits < 2:
            raise ValueError(
                "value_bits must be 2 to 8 (velox_core.Uniform); bits=1 sets only the keys' "
                "sign code, so pass value_bits with it"
            )
        check_int("group", self.group, minimum=1)
        check_int("centroid", self.centroid, minimum=0)
        check_int("rounds", self.rounds, minimum=1, maximum=8)
        check_int("window", self.window, minimum=0)
        check_int("sinks", self.sinks, minimum=0)
        check_int("seed", self.seed, minimum=0)
