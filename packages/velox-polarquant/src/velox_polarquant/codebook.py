"""The laws of PolarQuant's angles and their Lloyd-Max codebooks (arXiv 2502.02617).

After a random rotation a key (or value) ``x`` of ``R^d`` is a uniform point of the sphere
of radius ``||x||``: its direction is that of a Gaussian vector ``N(0, I_d)``. The recursive
polar transform of a Gaussian vector (Lemma 2) has independent angles, and all the angles of
one level share one law:

- level 1, the angle of a pair of coordinates, ``atan2(x_2j, x_2j-1)``: uniform on
  ``[0, 2 pi)``;
- level ``l >= 2``, the angle between the norms of two halves of a block of ``2^l``
  coordinates, ``atan(r_2j / r_2j-1)`` in ``[0, pi/2]``: density proportional to
  ``sin(2 psi)^(2^(l-1) - 1)``, symmetric about ``pi/4`` and narrower at every level
  (variance ``O(2^-l)``).

Each level's codebook minimizes the mean squared angle error under its law (Eq. 4, the
continuous 1-D k-means problem). The paper approximates it by 1-D k-means++ on sampled
angles ("offline") or on the prompt's own angles ("online"); the offline codebook here is
its exact solution, Lloyd's iteration on a fine quadrature grid of the density
(:func:`velox_core.ops.lloyd_max`). Level 1's is the uniform quantizer, cells of
``2 pi / 2^b`` with their midpoints as levels.
"""

from __future__ import annotations

import math
from functools import cache

import numpy as np

from velox_core.ops import Codebook, lloyd_max
from velox_core.validation import check_bits, check_int

__all__ = ["MAX_LEVELS", "angle_density", "angle_range", "level_codebook"]

MAX_LEVELS = 12  # recursion depth allowed (a head dim of 4096 coordinates)
_GRID = 1 << 18


def angle_range(level: int) -> tuple[float, float]:
    """The interval a level's angles lie in: ``[0, 2 pi)`` at level 1, ``[0, pi/2]`` above."""
    check_int("level", level, minimum=1, maximum=MAX_LEVELS)
    return (0.0, 2 * math.pi) if level == 1 else (0.0, math.pi / 2)


def angle_density(level: int, psi: np.ndarray) -> np.ndarray:
    """The density of a level's angles for a Gaussian (or uniformly rotated) vector (Lemma 2),
    normalized: ``1 / (2 pi)`` at level 1, ``c_l sin(2 psi)^(2^(l-1) - 1)`` above, with
    ``c_l = Gamma(2^(l-1)) / (2^(2^(l-1) - 2) Gamma(2^(l-2))^2)``.

    Shapes: psi any shape (radians, inside :func:`angle_range`); returns the same shape.
    """
    check_int("level", level, minimum=1, maximum=MAX_LEVELS)
    psi = np.asarray(psi, dtype=np.float64)
    if level == 1:
        return np.full(psi.shape, 1 / (2 * math.pi))
    n = 2 ** (level - 1)
    log_c = math.lgamma(n) - (n - 2) * math.log(2) - 2 * math.lgamma(n / 2)
    s = np.clip(np.sin(2 * psi), 0.0, 1.0)
    with np.errstate(divide="ignore"):
        return np.exp(log_c + (n - 1) * np.log(s))


@cache
def level_codebook(level: int, bits: int) -> Codebook:
    """The Lloyd-Max codebook of a level's angles at ``bits`` bits (``2^bits`` levels).

    Level 1: the uniform quantizer of ``[0, 2 pi)``. Levels 2 and up: Lloyd's iteration on
    the density of :func:`angle_density`, solved centred on ``pi/4`` with the mirror symmetry
    enforced, then moved back. ``mse`` is the expected squared angle error (radians^2).
    """
    check_int("level", level, minimum=1, maximum=MAX_LEVELS)
    check_bits("bits", bits)
    if level == 1:  # the uniform law's optimum: equal cells, levels at their midpoints
        step = 2 * math.pi / (1 << bits)
        centroids = ((np.arange(1 << bits) + 0.5) * step).astype(np.float32)
        bounds = (np.arange(1, 1 << bits) * step).astype(np.float32)
        return Codebook(centroids, bounds, step * step / 12, bits)
    half = math.pi / 4
    t = np.linspace(-half, half, _GRID + 1)[1:-1]  # psi - pi/4: the density is even in t
    cb = lloyd_max(t, angle_density(level, t + half), bits, iters=2000, symmetric=True)
    return Codebook(
        (cb.centroids + np.float32(half)).astype(np.float32),
        (cb.boundaries + np.float32(half)).astype(np.float32),
        cb.mse,
        bits,
    )
