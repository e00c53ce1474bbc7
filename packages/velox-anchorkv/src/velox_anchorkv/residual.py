"""AnchorKV's residual codec (arXiv 2608.02901, Section 3.1 and Appendix A.1).

A residual ``r`` (what a token's anchor projection misses) is rotated by a seeded randomized
Hadamard transform, which spreads its energy evenly over the coordinates, normalized by its
largest coordinate (per-token absmax) and quantized coordinate by coordinate with the
Lloyd-Max codebook of a unit Gaussian (2 bits: 4 levels), codes packed 16 to a uint32 word
(4 to a byte).

The absmax of ``D`` rotated coordinates is about ``g_D = E[max_i |z_i|]`` standard deviations
(``z`` standard normal, :func:`gaussian_absmax`), so ``u = g_D · y / max|y|`` is close to
unit Gaussian and meets the codebook's law; the scale stored per residual is
``max|y| / g_D`` (float16), and a coordinate decodes as ``level · scale``.
"""

from __future__ import annotations

import math
from functools import cache

import mlx.core as mx
import numpy as np

from velox_core.ops import (
    BYTE_BITS,
    HadamardRotation,
    byte_table,
    lookup,
    pack,
    packed_words,
    unpack,
)
from velox_core.ops.lloyd_max import lloyd_max_gaussian

__all__ = ["ResidualCodec", "gaussian_absmax"]

SLOT_BYTES = 4 + 2  # a residual's int32 slot (head * S + token) and float16 scale


@cache
def gaussian_absmax(dim: int) -> float:
    """``E[max_i |z_i|]`` for ``dim`` independent standard normal ``z_i`` (numerical
    integral of ``1 - P(max <= t)``)."""
    t = np.linspace(0.0, 12.0, 24001)
    cdf = np.array([math.erf(x / math.sqrt(2.0)) for x in t]) ** dim
    f = 1.0 - cdf
    return float(np.sum((f[1:] + f[:-1]) / 2) * (t[1] - t[0]))


class ResidualCodec:
    """Residuals of ``dim`` channels at ``bits`` bits a coordinate.

    Args:
        dim: channels (even).
        bits: code width, 1 to 8.
        seed: the Hadamard rotation's seed.
    """

    def __init__(self, dim: int, bits: int, seed: int):
        self.dim, self.bits = dim, bits
        self.rotation = HadamardRotation(dim, seed=seed)
        self.book = lloyd_max_gaussian(bits)
        self.gain = gaussian_absmax(dim)
        levels = self.book.levels()
        self.table = byte_table(levels, bits) if bits in BYTE_BITS else None

    @property
    def words(self) -> int:
        """uint32 words of one residual's codes."""
        return packed_words(self.dim, self.bits)

    @property
    def slot_bytes(self) -> int:
        """Bytes of one stored residual: codes, scale and slot index."""
        return 4 * self.words + SLOT_BYTES

    def encode(self, r: mx.array) -> tuple[mx.array, mx.array]:
        """Shapes: r ``(..., dim)``; returns codes uint32 ``(..., words)`` and scales float16
        ``(...)``."""
        y = self.rotation.forward(r)
        amax = mx.max(mx.abs(y), axis=-1, keepdims=True)
        scale = (amax / self.gain).astype(mx.float16)
        s = scale.astype(mx.float32)
        u = mx.where(s > 0, y / mx.maximum(s, 1e-30), 0.0)
        return pack(self.quantize(u), self.bits), scale[..., 0]

    def quantize(self, u: mx.array) -> mx.array:
        """The nearest level's code of each coordinate: the number of decision boundaries at
        or below it (the levels are sorted), counted in uint8 (no int32 or float copy of
        ``u`` per boundary; above 4 bits, the codebook's binary search).

        Shapes: u ``(...)`` float32; returns uint8 codes of the same shape."""
        if self.bits > 4:
            return self.book.encode(u)
        codes = mx.zeros(u.shape, dtype=mx.uint8)
        for b in self.book.boundaries.tolist():
            codes = codes + (u >= b).astype(mx.uint8)
        return codes

    def levels(self, codes: mx.array, scale: mx.array) -> mx.array:
        """The residuals in the rotated domain, ``level · scale``: float32 ``(..., dim)``
        (one gather through a per-byte table at 1, 2, 4 and 8 bits).

        Shapes: codes uint32 ``(..., words)``, scale ``(...)``."""
        if self.table is not None:
            lv = lookup(codes, self.bits, self.dim, self.table)
        else:
            lv = self.book.decode(unpack(codes, self.bits, self.dim))
        return lv * scale.astype(mx.float32)[..., None]

    def decode(self, codes: mx.array, scale: mx.array) -> mx.array:
        """Shapes: codes uint32 ``(..., words)``, scale ``(...)``; returns float32
        ``(..., dim)``."""
        return self.rotation.inverse(self.levels(codes, scale))
