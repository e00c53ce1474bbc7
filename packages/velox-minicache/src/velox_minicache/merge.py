"""MiniCache's merge of two layers' states: SLERP of the directions, the magnitudes apart.

MiniCache (arXiv 2405.14366, Section 4.1) writes a token's state ``x`` at layers ``l-1`` and
``l`` as magnitude times direction, ``x = ||x|| u``, and stores one direction for the pair,
the spherical interpolation of the two::

    Omega = arccos(u_{l-1} . u_l)
    e     = sin((1 - t) Omega) / sin(Omega) * u_{l-1} + sin(t Omega) / sin(Omega) * u_l

with each layer's magnitude beside it; a layer's state is restored as ``||x_l|| e``. Token
pairs whose directions disagree most (angular distance ``d = Omega / pi`` within ``gamma`` of
the largest, see :func:`retained`) are not merged: both layers keep them as given.

Everything here is per row: a row is one KV head of one token, ``(B, H, n, D)`` arrays.
"""

from __future__ import annotations

import math

import mlx.core as mx

__all__ = ["distance_range", "restore", "retained", "slerp_merge"]

_PARALLEL = 1e-6  # sin(Omega) below this: the two directions are (anti)parallel


def slerp_merge(
    x1: mx.array, x2: mx.array, t: float
) -> tuple[mx.array, mx.array, mx.array, mx.array]:
    """The merged direction of two layers' states, their magnitudes and angular distances.

    Where the directions are (anti)parallel SLERP is ill-conditioned: for parallel ones the
    linear interpolation of the unit vectors takes its place (SLERP's limit), and where the
    result cancels (opposite directions, at the largest distance, which retention keeps
    apart) layer ``l-1``'s direction does. The result is normalized (a unit vector in exact
    arithmetic; this removes rounding only).

    Shapes:
        x1 (layer ``l-1``), x2 (layer ``l``): ``(B, H, n, D)``; returns ``e`` ``(B, H, n, D)``
        (unit rows), ``|x1|`` and ``|x2|`` ``(B, H, n)`` and ``d = Omega / pi`` ``(B, H, n)``
        in ``[0, 1]``, all float32.
    """
    x1, x2 = x1.astype(mx.float32), x2.astype(mx.float32)
    n1 = mx.sqrt(mx.sum(x1 * x1, axis=-1, keepdims=True))
    n2 = mx.sqrt(mx.sum(x2 * x2, axis=-1, keepdims=True))
    u1 = x1 / mx.maximum(n1, 1e-30)
    u2 = x2 / mx.maximum(n2, 1e-30)
    cos = mx.clip(mx.sum(u1 * u2, axis=-1, keepdims=True), -1.0, 1.0)
    omega = mx.arccos(cos)
    s = mx.sin(omega)
    flat = s < _PARALLEL
    safe = mx.where(flat, 1.0, s)
    e = (mx.sin((1.0 - t) * omega) / safe) * u1 + (mx.sin(t * omega) / safe) * u2
    e = mx.where(flat, (1.0 - t) * u1 + t * u2, e)
    # a unit vector in exact arithmetic; (nearly) opposite directions cancel in floating
    # point, where no great circle is defined: layer l-1's direction stands in
    norm = mx.sqrt(mx.sum(e * e, axis=-1, keepdims=True))
    e = mx.where(norm > 1e-3, e / mx.maximum(norm, 1e-30), u1)
    return e, n1[..., 0], n2[..., 0], omega[..., 0] / math.pi


def distance_range(
    d: mx.array, lo: mx.array | None, hi: mx.array | None
) -> tuple[mx.array, mx.array]:
    """The smallest and largest angular distance of each sequence, over every head and token
    merged so far (``lo``/``hi``, None for none) and the new ones ``d``.

    Shapes:
        d ``(B, H, n)``; lo, hi and the results ``(B,)`` float32.
    """
    b = d.shape[0]
    new_lo = mx.min(d.reshape(b, -1), axis=-1)
    new_hi = mx.max(d.reshape(b, -1), axis=-1)
    if lo is None:
        return new_lo, new_hi
    return mx.minimum(lo, new_lo), mx.maximum(hi, new_hi)


def retained(d: mx.array, lo: mx.array, hi: mx.array, gamma: float) -> mx.array:
    """Rows kept unmerged: ``d > d_max - gamma * (d_max - d_min)`` per sequence.

    Shapes:
        d ``(B, H, n)``; lo, hi ``(B,)``; returns bool ``(B, H, n)``.
    """
    threshold = hi - gamma * (hi - lo)
    return d > threshold[:, None, None]


def restore(e: mx.array, m: mx.array) -> mx.array:
    """A layer's merged states, ``m * e``: ``e`` ``(B, H, T, D)``, ``m`` ``(B, H, T)``;
    returns float32 ``(B, H, T, D)``."""
    return e.astype(mx.float32) * m.astype(mx.float32)[..., None]
