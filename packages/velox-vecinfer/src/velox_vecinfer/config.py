"""Settings of the VecInfer cache, and the (bits, vector) pairs a codebook can have."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from velox_core import CodeWidths
from velox_core.validation import check_bool, check_counts, check_int

__all__ = [
    "VECTORS",
    "VecInferConfig",
    "check_vector",
    "check_width",
    "index_bits",
]

VECTORS = (1, 2, 4, 8)  # sub-vector lengths (channels coded together by one index)
MAX_INDEX_BITS = 8  # codebooks of at most 256 entries


def check_vector(name: str, value: Any) -> int:
    """A sub-vector length: 1, 2, 4 or 8."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(
            f"{name} must be an int (1, 2, 4 or 8), got {type(value).__name__} {value!r}"
        )
    if value not in VECTORS:
        raise ValueError(f"{name} must be one of 1, 2, 4, 8 (channels per sub-vector); got {value}")
    return value


def check_width(name: str, bits: Any) -> int | float:
    """A positive, finite number of bits per channel (an int when integral)."""
    if isinstance(bits, bool) or not isinstance(bits, (int, float)):
        raise TypeError(f"{name} must be a number of bits, got {type(bits).__name__} {bits!r}")
    if not math.isfinite(bits) or bits <= 0:
        raise ValueError(f"{name} must be a positive number of bits, got {bits}")
    return int(bits) if float(bits).is_integer() else float(bits)


def index_bits(name: str, bits: Any, vector: int) -> tuple[int | float, int]:
    """Check a width against a sub-vector length.

    Returns ``(bits, index_bits)``: ``bits`` as an int when integral, and the index width
    ``bits * vector``, which must be a whole number from 1 to 8 (a codebook of ``2**index_bits``
    entries, at most 256).

    Raises:
        TypeError: ``bits`` is not a number.
        ValueError: ``bits * vector`` is not a whole number in ``[1, 8]``.
    """
    bits = check_width(name, bits)
    ib = bits * vector
    whole = round(ib)
    if abs(ib - whole) > 1e-9 or not 1 <= whole <= MAX_INDEX_BITS:
        allowed = ", ".join(f"{k / vector:g}" for k in range(1, MAX_INDEX_BITS + 1))
        raise ValueError(
            f"{name}={bits} with vector={vector} gives {ib:g} index bits per sub-vector; "
            f"{name} x vector must be a whole number from 1 to {MAX_INDEX_BITS} (a codebook of "
            f"at most 256 entries): with vector={vector}, {name} may be {allowed}"
        )
    return bits, int(whole)


@dataclass
class VecInferConfig(CodeWidths):
    """VecInfer (arXiv 2510.06175) settings, with the shared parameter names.

    Attributes:
        bits: bits per channel of keys and values (the paper: 2; 1.25 to 2 explored). Each
            sub-vector of ``vector`` channels is one index of ``bits * vector`` bits, which must
            be a whole number from 1 to 8.
        key_bits, value_bits: either alone (default ``bits``).
        vector: channels per sub-vector (1, 2, 4 or 8), for keys and values.
        key_vector, value_vector: either alone (default ``vector``).
        smooth: divide each key channel by its calibration maximum (queries are multiplied
            by it, so ``q . k`` is unchanged) before vector quantization.
        hadamard: apply the orthonormal Walsh-Hadamard transform to keys and queries after
            smoothing (a block-diagonal one for head dims that are not powers of two).
        sinks: first tokens kept in fp16 (not in the paper; 0 by default).
        window: most recent tokens kept in fp16 (not in the paper; 0 by default).
        calibration: tokens (after the sinks) gathered in fp16 before the smoothing scales and
            both codebooks are fitted on them; every sub-vector of them is a k-means sample,
            so ``calibration * head_dim / vector`` must reach the codebook size (checked on
            the first tokens, when the head dim is known).
        iters: Lloyd iterations of k-means after k-means++ seeding (0: the seeding only).
        seed: seed of the k-means++ seeding.
    """

    bits: int | float = 2
    vector: int = 4
    key_vector: int | None = None
    value_vector: int | None = None
    smooth: bool = True
    hadamard: bool = True
    sinks: int = 0
    window: int = 0
    calibration: int = 256
    iters: int = 25
    seed: int = 0

    def __post_init__(self):
        self.vector = check_vector("vector", self.vector)
        for name in ("key_vector", "value_vector"):
            if getattr(self, name) is not None:
                check_vector(name, getattr(self, name))
        kv = self.vector if self.key_vector is None else self.key_vector
        vv = self.vector if self.value_vector is None else self.value_vector
        # bits must suit the sub-vector length of each side it applies to
        if self.key_bits is None:
            self.bits = index_bits("bits", self.bits, kv)[0]
        if self.value_bits is None:
            self.bits = index_bits("bits", self.bits, vv)[0]
        if self.key_bits is not None and self.value_bits is not None:
            self.bits = check_width("bits", self.bits)  # applies to neither side
        if self.key_bits is not None:
            self.key_bits = index_bits("key_bits", self.key_bits, kv)[0]
        if self.value_bits is not None:
            self.value_bits = index_bits("value_bits", self.value_bits, vv)[0]
        check_bool("smooth", self.smooth)
        check_bool("hadamard", self.hadamard)
        check_counts(self, "sinks", "window", "iters", "seed")
        check_int("calibration", self.calibration, minimum=1)

    def sides(self) -> tuple[tuple[int | float, int], tuple[int | float, int]]:
        """``((key_bits, key_vector), (value_bits, value_vector))`` with the defaults resolved."""
        kb, vb = self.widths
        kv = self.vector if self.key_vector is None else self.key_vector
        vv = self.vector if self.value_vector is None else self.value_vector
        return (kb, kv), (vb, vv)
