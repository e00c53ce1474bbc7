"""PolarQuant's recursive polar transform (arXiv 2502.02617, Definition 1 and Algorithm 1).

A vector ``y`` of ``R^d`` is cut into pairs of coordinates; each pair becomes a radius and an
angle (level 1, angles in ``[0, 2 pi)``). The ``d/2`` radii are cut into pairs again, and each
pair of radii becomes a radius and an angle (level 2, in ``[0, pi/2]``: both radii are
non-negative), and so on. After ``L`` levels a vector holds ``d / 2^L`` radii (the norms of
its blocks of ``2^L`` consecutive coordinates) and ``d/2 + d/4 + ... + d/2^L`` angles; with
``L = log2 d`` one radius, the norm, and ``d - 1`` angles. The inverse walks the levels back
down: a radius ``r`` and an angle ``psi`` give the pair ``(r cos psi, r sin psi)``.
"""

from __future__ import annotations

import math

import mlx.core as mx

__all__ = ["from_polar", "to_polar"]


def to_polar(y: mx.array, levels: int) -> tuple[list[mx.array], mx.array]:
    """The angles of every level and the top radii of ``y``.

    Args:
        y: float32 ``(..., d)`` with ``2^levels`` dividing ``d``.
        levels: recursion depth ``L``, at least 1.

    Returns:
        ``(angles, radii)``: ``angles[l - 1]`` float32 ``(..., d / 2^l)`` (level 1 in
        ``[0, 2 pi)``, the others in ``[0, pi/2]``) and radii float32 ``(..., d / 2^L)``.
    """
    lead, d = y.shape[:-1], y.shape[-1]
    angles, r = [], y
    for level in range(1, levels + 1):
        pairs = r.reshape(*lead, d >> level, 2)
        a, b = pairs[..., 0], pairs[..., 1]
        psi = mx.arctan2(b, a)
        if level == 1:  # atan2 gives (-pi, pi]: the paper's [0, 2 pi)
            psi = mx.where(psi < 0, psi + 2 * math.pi, psi)
        angles.append(psi)
        r = mx.sqrt(a * a + b * b)
    return angles, r


def from_polar(radii: mx.array, cos_sin: list[mx.array]) -> mx.array:
    """The vector of its top radii and its angles' ``(cos, sin)`` factors (DeQuant).

    Args:
        radii: ``(..., m)``, the radii of the last level (``m = d / 2^L``).
        cos_sin: per level, from 1 to ``L``, ``(..., 2 d / 2^l)``: each angle's
            ``cos psi, sin psi`` interleaved, in the angles' order.

    Returns:
        float32 ``(..., d)``.
    """
    lead = radii.shape[:-1]
    y = radii.astype(mx.float32)
    for cs in reversed(cos_sin):
        m = y.shape[-1]
        y = (y[..., None] * cs.reshape(*lead, m, 2)).reshape(*lead, 2 * m)
    return y
