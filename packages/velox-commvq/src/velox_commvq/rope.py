"""The model's rotary position embedding, seen as a rotation of each channel pair.

CommVQ (arXiv 2506.18879, https://arxiv.org/abs/2506.18879) codes keys before RoPE and lets
RoPE act on the codes. RoPE rotates pair ``p`` of a head's channels by the angle
``position * theta[p]``; which channels form a pair is the layout of the model's RoPE:
``mlx.nn.RoPE(traditional=False)`` (mlx-lm's default) pairs channels ``(i, i + dims/2)``,
``traditional=True`` pairs adjacent channels ``(2i, 2i+1)``. A head dim ``D`` holds ``D/2``
pairs: the ``dims/2`` rotated ones first, then the channels RoPE leaves alone (partial rotary),
paired the same way, with angle 0.

A pair ``(x1, x2)`` is the complex number ``x1 + i x2`` here; RoPE multiplies it by
``exp(i * position * theta)`` (what ``mx.fast.rope`` does). A constant factor some RoPEs apply
(YaRN's and LongRoPE's ``mscale``) commutes with the rotation and is not modelled: un-rotating
yields the scaled pre-RoPE key, which codes just as well.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np

__all__ = [
    "RopeSpec",
    "angles",
    "find_rope",
    "from_pairs",
    "rope_spec",
    "rotate_pairs",
    "to_pairs",
]

_ATTENTION_NAMES = ("self_attn", "attention", "attn")
_ROPE_NAMES = ("rope", "rotary_emb")


@dataclass(frozen=True)
class RopeSpec:
    """Angular frequencies and pair layout of a RoPE.

    Attributes:
        theta: ``(dims // 2,)`` float32 numpy array, radians per position of each pair.
        dims: number of rotated channels (the first ``dims`` of the head).
        traditional: pairs are adjacent channels ``(2i, 2i+1)`` when True, else ``(i, i+dims/2)``.
    """

    theta: np.ndarray
    dims: int
    traditional: bool

    @staticmethod
    def from_base(base: float, dims: int, traditional: bool = False, scale: float = 1.0):
        """The frequencies of ``mlx.nn.RoPE(dims, traditional, base, scale)``."""
        theta = scale * base ** (-np.arange(0, dims, 2, dtype=np.float64) / dims)
        return RopeSpec(theta.astype(np.float32), dims, traditional)

    def arrays(self) -> dict[str, mx.array]:
        """The spec as codec state arrays (saved with the cache)."""
        layout = np.array([self.dims, int(self.traditional)], dtype=np.int32)
        return {"rope_theta": mx.array(self.theta), "rope_layout": mx.array(layout)}

    @staticmethod
    def from_arrays(theta: mx.array, layout: mx.array) -> RopeSpec:
        dims, trad = (int(v) for v in np.array(layout))
        return RopeSpec(np.array(theta, dtype=np.float32), dims, bool(trad))

    @property
    def layout(self) -> list[int]:
        """``[dims, traditional]``: what fixes which channels form each pair."""
        return [self.dims, int(self.traditional)]

    def same_as(self, other: RopeSpec) -> bool:
        return self.layout == other.layout and np.allclose(self.theta, other.theta, rtol=1e-5)

    def describe(self) -> str:
        return f"dims={self.dims}, traditional={self.traditional}"

    def pairs(self, dim: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Channels and angles of the ``dim // 2`` pairs of a head of ``dim`` channels.

        Returns:
            ``(first, second, theta)``: int32 channel indices of each pair's two channels and
            float32 radians per position (0 for the channels RoPE leaves alone).
        """
        if dim % 2 or self.dims > dim or (dim - self.dims) % 2:
            raise ValueError(f"commvq: RoPE of {self.dims} channels does not pair a {dim}-dim head")
        out = []
        for start, n in ((0, self.dims), (self.dims, dim - self.dims)):
            half = np.arange(n // 2)
            if self.traditional:
                out.append((start + 2 * half, start + 2 * half + 1))
            else:
                out.append((start + half, start + n // 2 + half))
        first = np.concatenate([out[0][0], out[1][0]]).astype(np.int32)
        second = np.concatenate([out[0][1], out[1][1]]).astype(np.int32)
        theta = np.concatenate([self.theta, np.zeros((dim - self.dims) // 2, np.float32)])
        return first, second, theta.astype(np.float32)


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


def rope_spec(rope: Any) -> RopeSpec:
    """The :class:`RopeSpec` of an MLX / mlx-lm RoPE module.

    Supports ``mlx.nn.RoPE`` and mlx-lm's ``Llama3RoPE``, ``YarnRoPE``, ``SuScaledRoPE`` and
    ``ProportionalRoPE``.

    Raises:
        TypeError: for other classes, including ``DynamicNTKScalingRoPE`` (its base depends on
            the sequence length when each key was computed).
    """
    from mlx_lm.models import rope_utils as ru

    if isinstance(rope, nn.RoPE):
        return RopeSpec.from_base(rope.base, rope.dims, rope.traditional, rope.scale)
    fixed = (ru.Llama3RoPE, ru.YarnRoPE, ru.SuScaledRoPE, ru.ProportionalRoPE)
    if isinstance(rope, fixed):
        dims = rope.dim if isinstance(rope, ru.SuScaledRoPE) else rope.dims
        with np.errstate(divide="ignore"):
            theta = 1.0 / np.array(rope._freqs, dtype=np.float64)  # inf freqs: unrotated
        return RopeSpec(theta.astype(np.float32), int(dims), bool(getattr(rope, "traditional", 0)))
    raise TypeError(
        f"commvq: unsupported RoPE class {type(rope).__module__}.{type(rope).__name__} (a "
        "cached key must be un-rotatable from its position alone); supported: mlx.nn.RoPE, "
        "mlx_lm rope_utils Llama3RoPE, YarnRoPE, SuScaledRoPE, ProportionalRoPE"
    )


def find_rope(model: Any, layer: int) -> Any:
    """The RoPE module of layer ``layer`` of an mlx-lm model
    (``model.layers[layer].<self_attn|attention|attn>.<rope|rotary_emb>``).

    Raises:
        ValueError: when the model has no such layer or module.
    """
    layers = getattr(model, "layers", None)
    if layers is None or not 0 <= layer < len(layers):
        raise ValueError(f"commvq: the model has no layer {layer} to read the RoPE from")
    for a in _ATTENTION_NAMES:
        attn = getattr(layers[layer], a, None)
        for r in _ROPE_NAMES:
            rope = getattr(attn, r, None) if attn is not None else None
            if rope is not None:
                return rope
    raise ValueError(
        f"commvq: layer {layer} ({type(layers[layer]).__name__}) has no attention RoPE module "
        f"(looked for {'/'.join(_ATTENTION_NAMES)}.{'/'.join(_ROPE_NAMES)})"
    )
