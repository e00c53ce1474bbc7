"""A model's rotary position embedding (RoPE), read from its modules, undone and redone.

mlx-lm rotates keys before the cache sees them. Methods that work on *pre-RoPE* keys (the
pre-RoPE key codecs, cross-model transfer) turn each key back at its absolute position, and turn
keys rebuilt from their codes forward again. A RoPE is its angular frequencies ``theta``
(radians per position, one per rotated channel pair), the number ``dims`` of rotated channels
(the first ones of the head) and the pair layout: ``traditional`` pairs channels
``(2i, 2i+1)``, otherwise ``(i, i + dims/2)`` (mlx-lm's default), which is all
``mx.fast.rope`` uses. A head of ``D > dims`` channels keeps the rest unrotated (partial
rotary), paired the same way with angle 0. A constant gain some RoPEs put on the rotated
channels (YaRN's and LongRoPE's ``mscale``) commutes with the rotation and only rescales the
pre-RoPE keys, so it is not modelled.

A pair ``(x1, x2)`` is the complex number ``x1 + i x2``: RoPE multiplies it by
``exp(i * position * theta)``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np

__all__ = [
    "RopeSpec",
    "fast_rotate",
    "find_rope",
    "rope_spec",
    "rotate",
]

_ATTENTION_NAMES = ("self_attn", "attention", "attn")
_ROPE_NAMES = ("rope", "rotary_emb")
_SUPPORTED = (
    "mlx.nn.RoPE and mlx_lm's Llama3RoPE, YarnRoPE, SuScaledRoPE, ProportionalRoPE "
    "(fixed frequencies)"
)


@dataclass(frozen=True)
class RopeSpec:
    """Frequencies ``theta`` (``(dims // 2,)`` float32), ``dims`` and ``traditional``."""

    theta: np.ndarray
    dims: int
    traditional: bool

    @staticmethod
    def from_base(base: float, dims: int, traditional: bool = False, scale: float = 1.0):
        """The frequencies of ``mlx.nn.RoPE(dims, traditional, base, scale)``."""
        theta = scale * base ** (-np.arange(0, dims, 2, dtype=np.float64) / dims)
        return RopeSpec(theta.astype(np.float32), dims, traditional)

    def arrays(self) -> dict[str, mx.array]:
        """As arrays, to be saved with a cache (a loaded cache needs no model)."""
        layout = np.array(self.layout, dtype=np.int32)
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
        return self.layout == other.layout and np.allclose(
            self.theta, other.theta, rtol=1e-5, atol=0
        )

    def describe(self) -> str:
        return f"dims={self.dims}, traditional={self.traditional}"

    def pairs(self, dim: int, method: str = "velox") -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Channels and angles of the ``dim // 2`` pairs of a head of ``dim`` channels.

        Returns:
            ``(first, second, theta)``: int32 channel indices of each pair's two channels and
            float32 radians per position (0 for the channels RoPE leaves alone).
        """
        if dim % 2 or self.dims > dim or (dim - self.dims) % 2:
            raise ValueError(
                f"{method}: a RoPE of {self.dims} channels does not pair a {dim}-dim head"
            )
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


def rope_spec(rope: Any, method: str = "velox", hint: str = "") -> RopeSpec:
    """The :class:`RopeSpec` of ``mlx.nn.RoPE`` or of mlx-lm's fixed-frequency RoPEs
    (``Llama3RoPE``, ``YarnRoPE``, ``SuScaledRoPE``, ``ProportionalRoPE``).

    ``method`` names the caller in errors; ``hint`` is appended to them (what to do instead).

    Raises:
        TypeError: any other class, ``DynamicNTKScalingRoPE`` included (its base depends on
            the sequence length when each key was made, which a cache does not know).
    """
    from mlx_lm.models import rope_utils as ru

    if isinstance(rope, nn.RoPE):
        return RopeSpec.from_base(rope.base, rope.dims, rope.traditional, rope.scale)
    if isinstance(rope, (ru.Llama3RoPE, ru.YarnRoPE, ru.SuScaledRoPE, ru.ProportionalRoPE)):
        dims = rope.dim if isinstance(rope, ru.SuScaledRoPE) else rope.dims
        with np.errstate(divide="ignore"):
            theta = 1.0 / np.array(rope._freqs, dtype=np.float64)  # an inf period: unrotated
        return RopeSpec(theta.astype(np.float32), int(dims), bool(getattr(rope, "traditional", 0)))
    name = f"{type(rope).__module__}.{type(rope).__name__}"
    why = (
        " (it changes its base with the sequence length, so a cached key cannot be un-rotated "
        "from its position alone)"
        if isinstance(rope, ru.DynamicNTKScalingRoPE)
        else ""
    )
    raise TypeError(
        f"{method}: unsupported RoPE class {name}{why}; supported: {_SUPPORTED}"
        + (f"; {hint}" if hint else "")
    )


def find_rope(model: Any, layer: int, method: str = "velox", hint: str = "") -> Any:
    """``model.layers[layer].<self_attn|attention|attn>.<rope|rotary_emb>``.

    Raises:
        ValueError: the model has no such layer or module.
    """
    layers = getattr(model, "layers", None)
    if layers is None or not 0 <= layer < len(layers):
        raise ValueError(f"{method}: the model has no layer {layer} to read the RoPE from")
    for a in _ATTENTION_NAMES:
        attn = getattr(layers[layer], a, None)
        for r in _ROPE_NAMES:
            rope = getattr(attn, r, None) if attn is not None else None
            if rope is not None:
                return rope
    raise ValueError(
        f"{method}: layer {layer} ({type(layers[layer]).__name__}) has no attention RoPE module "
        f"(looked for {'/'.join(_ATTENTION_NAMES)}.{'/'.join(_ROPE_NAMES)})"
        + (f"; {hint}" if hint else "")
    )


def rotate(x: mx.array, positions: int | mx.array, spec: RopeSpec, inverse: bool = False):
    """RoPE (or its inverse) of tokens at absolute positions.

    ``positions`` is the first token's position (an int: tokens at ``positions,
    positions + 1, ...``) or integer positions broadcastable to ``(B, H, T)`` (e.g.
    ``(B, 1, T)`` or ``(T,)``).

    Shapes:
        x ``(B, H, T, D)``; returns float32 ``(B, H, T, D)``.
    """
    x = x.astype(mx.float32)
    d, half = spec.dims, spec.dims // 2
    if isinstance(positions, int):
        positions = mx.arange(positions, positions + x.shape[-2])
    ang = positions.astype(mx.float32)[..., None] * mx.array(spec.theta)  # (..., T, dims/2)
    cos, sin = mx.cos(ang), mx.sin(ang)
    if inverse:
        sin = -sin
    if spec.traditional:
        pairs = x[..., :d].reshape(*x.shape[:-1], half, 2)
        x1, x2 = pairs[..., 0], pairs[..., 1]
        rot = mx.stack([x1 * cos - x2 * sin, x1 * sin + x2 * cos], axis=-1)
        rot = rot.reshape(*rot.shape[:-2], d)
    else:
        x1, x2 = x[..., :half], x[..., half:d]
        rot = mx.concatenate([x1 * cos - x2 * sin, x1 * sin + x2 * cos], axis=-1)
    return rot if d == x.shape[-1] else mx.concatenate([rot, x[..., d:]], axis=-1)


def fast_rotate(x: mx.array, offset: mx.array, spec: RopeSpec, inverse: bool = False) -> mx.array:
    """:func:`rotate` of tokens at positions ``offset, offset + 1, ...`` through
    ``mx.fast.rope``, with the offset an array (one per batch row: no host synchronization).
    Negated frequencies give the inverse rotation.

    Shapes:
        x ``(B, H, T, D)``; offset int32 ``(B,)`` (or ``(1,)``); returns float32
        ``(B, H, T, D)``.
    """
    with np.errstate(divide="ignore"):
        freqs = 1.0 / np.asarray(spec.theta, dtype=np.float64)  # an inf period: unrotated
    freqs = mx.array((-freqs if inverse else freqs).astype(np.float32))
    return mx.fast.rope(
        x.astype(mx.float32),
        spec.dims,
        traditional=spec.traditional,
        base=None,
        scale=1.0,
        offset=offset,
        freqs=freqs,
    )
