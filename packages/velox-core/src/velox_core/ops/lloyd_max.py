"""Lloyd-Max scalar quantizers (MSE-optimal codebooks) for 1 to 8 bits.

:func:`lloyd_max` takes any source law sampled on a grid (method packages bring their own
laws: the sphere law of a rotated unit vector's coordinate, a Laplacian...);
:func:`lloyd_max_gaussian` is the standard normal ``N(0, 1)``'s.

Codebooks are computed once by Lloyd's iteration on a fine quadrature grid (prefix sums make
each iteration O(levels)), starting from the companding (``f^(1/3)``) high-rate solution.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache

import mlx.core as mx
import numpy as np

from ..validation import check_bits

__all__: list[str] = []

_GRID = 1 << 18


@dataclass(frozen=True)
class Codebook:
    """A sorted scalar codebook.

    Attributes:
        centroids: ``(2**bits,)`` float32 reconstruction levels, ascending.
        boundaries: ``(2**bits - 1,)`` float32 decision thresholds (midpoints).
        mse: mean squared error of the quantizer under its source law.
        bits: code width.
    """

    centroids: np.ndarray
    boundaries: np.ndarray
    mse: float
    bits: int

    def levels(self) -> mx.array:
        return mx.array(self.centroids)

    def encode(self, x: mx.array) -> mx.array:
        """Nearest-centroid codes by a binary search over the boundaries (``bits`` steps).

        Shapes:
            x: any shape; returns uint8 codes of the same shape.
        """
        b = mx.array(self.boundaries)
        idx = mx.zeros(x.shape, dtype=mx.int32)
        x = x.astype(mx.float32)
        for k in reversed(range(self.bits)):
            cand = idx + (1 << k)
            idx = mx.where(x >= mx.take(b, cand - 1), cand, idx)
        return idx.astype(mx.uint8)

    def decode(self, codes: mx.array) -> mx.array:
        """Shapes: codes of any shape; returns float32 levels of the same shape."""
        return mx.take(mx.array(self.centroids), codes.astype(mx.int32))


def lloyd_max(
    grid: np.ndarray, pdf: np.ndarray, bits: int, iters: int = 400, symmetric: bool = False
) -> Codebook:
    """Lloyd-Max codebook for the law with density ``pdf`` sampled on the sorted ``grid``.

    ``symmetric`` averages each iterate with its mirror image (for laws symmetric about 0),
    which removes the rounding drift of the prefix sums in the far tails.
    """
    check_bits("bits", bits)
    w = pdf / pdf.sum()
    cw, cm, cs = np.cumsum(w), np.cumsum(w * grid), np.cumsum(w * grid * grid)
    cw, cm, cs = (np.concatenate([[0.0], c]) for c in (cw, cm, cs))
    levels = 1 << bits
    # high-rate start: levels at the quantiles of f^(1/3)
    comp = np.cumsum(np.cbrt(w))
    comp /= comp[-1]
    c = np.interp((np.arange(levels) + 0.5) / levels, comp, grid)
    for _ in range(iters):
        t = (c[1:] + c[:-1]) / 2
        edges = np.concatenate([[0], np.searchsorted(grid, t), [len(grid)]])
        mass = cw[edges[1:]] - cw[edges[:-1]]
        mom = cm[edges[1:]] - cm[edges[:-1]]
        new = np.where(mass > 0, mom / np.maximum(mass, 1e-300), c)
        if symmetric:
            new = (new - new[::-1]) / 2
        if np.max(np.abs(new - c)) < 1e-12:
            c = new
            break
        c = new
    t = (c[1:] + c[:-1]) / 2
    edges = np.concatenate([[0], np.searchsorted(grid, t), [len(grid)]])
    mass = cw[edges[1:]] - cw[edges[:-1]]
    mom = cm[edges[1:]] - cm[edges[:-1]]
    sq = cs[edges[1:]] - cs[edges[:-1]]
    mse = float(np.sum(sq - 2 * c * mom + c * c * mass))
    return Codebook(c.astype(np.float32), t.astype(np.float32), mse, bits)


@cache
def lloyd_max_gaussian(bits: int) -> Codebook:
    """Lloyd-Max codebook for ``N(0, 1)``; ``mse`` is the per-coordinate distortion."""
    check_bits("bits", bits)
    grid = np.linspace(-12.0, 12.0, _GRID)
    return lloyd_max(grid, np.exp(-0.5 * grid * grid), bits, iters=2000, symmetric=True)
