"""The model's RoPE, which xKV undoes before its SVD and redoes on rebuilt keys.

xKV (arXiv 2503.18893) factorizes *pre-RoPE* keys: RoPE turns each pair of channels by an
angle that grows with the position, which spreads the keys' energy over many more singular
directions. mlx-lm rotates keys before the cache sees them, so the cache turns each key back
at its absolute position before the fit, and turns rebuilt keys forward there again.

A RoPE is its angular frequencies ``theta`` (radians per position, one per rotated channel
pair), the number ``dims`` of rotated channels (the first ones of the head) and the pair
layout (``traditional``: channels ``(2i, 2i+1)``; otherwise ``(i, i + dims/2)``), which is
all ``mx.fast.rope`` uses. A constant gain some RoPEs put on the rotated channels (YaRN and
LongRoPE's ``mscale``) commutes with the rotation and only rescales the pre-RoPE keys.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np

__all__ = ["RopeSpec", "find_rope", "rope_spec", "rotate"]


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
        """As arrays, to be saved with the cache (a loaded cache needs no model)."""
        layout = np.array([self.dims, int(self.traditional)], dtype=np.int32)
        return {"rope_theta": mx.array(self.theta), "rope_layout": mx.array(layout)}

    @staticmethod
    def from_arrays(theta: mx.array, layout: mx.array) -> RopeSpec:
        dims, trad = (int(v) for v in np.array(layout))
        return RopeSpec(np.array(theta, dtype=np.float32), dims, bool(trad))

    def same_as(self, other: RopeSpec) -> bool:
        return (
            self.dims == other.dims
            and self.traditional == other.traditional
            and np.allclose(self.theta, other.theta, rtol=1e-5, atol=0)
        )


def rope_spec(rope: Any) -> RopeSpec:
    """The spec of ``mlx.nn.RoPE`` or of mlx-lm's fixed-frequency RoPEs (``Llama3RoPE``,
    ``YarnRoPE``, ``SuScaledRoPE``, ``ProportionalRoPE``).

    Raises:
        TypeError: any other class, ``DynamicNTKScalingRoPE`` included (its base depends on
            the sequence length when each key was made, which the cache does not know).
    """
    from mlx_lm.models import rope_utils as ru

    if isinstance(rope, nn.RoPE):
        return RopeSpec.from_base(rope.base, rope.dims, rope.traditional, rope.scale)
    if isinstance(rope, (ru.Llama3RoPE, ru.YarnRoPE, ru.SuScaledRoPE, ru.ProportionalRoPE)):
        dims = rope.dim if isinstance(rope, ru.SuScaledRoPE) else rope.dims
        with np.errstate(divide="ignore"):
            theta = 1.0 / np.array(rope._freqs, dtype=np.float64)  # an inf period: unrotated
        return RopeSpec(theta.astype(np.float32), int(dims), bool(getattr(rope, "traditional", 0)))
    raise TypeError(
        f"xkv: cannot undo RoPE class {type(rope).__module__}.{type(rope).__name__} at a known "
        "position (supported: mlx.nn.RoPE and mlx_lm's Llama3RoPE, YarnRoPE, SuScaledRoPE, "
        "ProportionalRoPE); use pre_rope=False"
    )


def find_rope(model: Any, layer: int) -> Any:
    """``model.layers[layer].<self_attn|attention|attn>.<rope|rotary_emb>``.

    Raises:
        ValueError: the model has no such layer or module.
    """
    layers = getattr(model, "layers", None)
    if layers is None or not 0 <= layer < len(layers):
        raise ValueError(f"xkv: the model has no layer {layer} to read the RoPE from")
    for a in ("self_attn", "attention", "attn"):
        attn = getattr(layers[layer], a, None)
        for r in ("rope", "rotary_emb"):
            rope = getattr(attn, r, None) if attn is not None else None
            if rope is not None:
                return rope
    raise ValueError(
        f"xkv: layer {layer} ({type(layers[layer]).__name__}) has no attention RoPE module; "
        "pass rope_base=... or use pre_rope=False"
    )


def rotate(x: mx.array, start: int, spec: RopeSpec, inverse: bool = False) -> mx.array:
    """RoPE (or its inverse) of tokens at positions ``start, start + 1, ...``.

    Shapes:
        x ``(B, H, T, D)``; returns float32 ``(B, H, T, D)``.
    """
    x = x.astype(mx.float32)
    d, half, t = spec.dims, spec.dims // 2, x.shape[2]
    pos = mx.arange(start, start + t, dtype=mx.float32)
    ang = pos[:, None] * mx.array(spec.theta)[None]  # (T, dims/2)
    cos, sin = mx.cos(ang), mx.sin(ang)
    if inverse:
        sin = -sin
    if spec.traditional:
        pairs = x[..., :d].reshape(*x.shape[:-1], half, 2)
        x1, x2 = pairs[..., 0], pairs[..., 1]
        rot = mx.stack([x1 * cos - x2 * sin, x1 * sin + x2 * cos], axis=-1).reshape(
            *x.shape[:-1], d
        )
    else:
        x1, x2 = x[..., :half], x[..., half:d]
        rot = mx.concatenate([x1 * cos - x2 * sin, x1 * sin + x2 * cos], axis=-1)
    return rot if d == x.shape[-1] else mx.concatenate([rot, x[..., d:]], axis=-1)
