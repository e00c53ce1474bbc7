"""RoPE's channel pairs as complex numbers: a key's pairs (:func:`to_pairs`, back with
:func:`from_pairs`), every pair's angle at a position (:func:`angles`) and the rotation by it
(:func:`rotate_pairs`), for CommVQ's codebooks of pre-RoPE pairs and its code-domain scores.

A pair ``(x1, x2)`` in the layout of a :class:`~velox_core.ops.rope.RopeSpec` is the complex
number ``x1 + i x2``: RoPE multiplies it by ``exp(i * position * theta)``.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from velox_core.ops.rope import RopeSpec

__all__ = ["angles", "from_pairs", "rotate_pairs", "to_pairs"]


def to_pairs(x: mx.array, spec: RopeSpec) -> mx.array:
    """The channel pairs of ``x`` in the RoPE's layout.

    Shapes:
        x ``(..., D)``; returns float32 ``(..., D/2, 2)``.
    """
    first, second, _ = spec.pairs(x.shape[-1])
    x = x.astype(mx.float32)
    return mx.stack([x[..., mx.array(first)], x[..., mx.array(second)]], axis=-1)


def from_pairs(z: mx.array, spec: RopeSpec) -> mx.array:
    """Inverse of :func:`to_pairs`.

    Shapes:
        z ``(..., P, 2)``; returns ``(..., 2P)``.
    """
    first, second, _ = spec.pairs(2 * z.shape[-2])
    order = np.argsort(np.concatenate([first, second]))
    flat = mx.concatenate([z[..., 0], z[..., 1]], axis=-1)
    return flat[..., mx.array(order.astype(np.int32))]


def angles(positions: mx.array, spec: RopeSpec, dim: int) -> tuple[mx.array, mx.array]:
    """``cos`` and ``sin`` of every pair's angle at the given positions.

    Shapes:
        positions integer ``(...)``; returns two float32 ``(..., dim/2)``.
    """
    theta = mx.array(spec.pairs(dim)[2])
    a = positions.astype(mx.float32)[..., None] * theta
    return mx.cos(a), mx.sin(a)


def rotate_pairs(z: mx.array, cos: mx.array, sin: mx.array, inverse: bool = False) -> mx.array:
    """Multiply each pair ``z1 + i z2`` by ``exp(+-i angle)``.

    Shapes:
        z ``(..., P, 2)``; cos, sin broadcastable to ``(..., P)``; returns ``(..., P, 2)``.
    """
    if inverse:
        sin = -sin
    z1, z2 = z[..., 0], z[..., 1]
    return mx.stack([z1 * cos - z2 * sin, z1 * sin + z2 * cos], axis=-1)
