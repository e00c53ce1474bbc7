"""The model's rotary position embedding, as SVDq needs it: to undo it and to redo it.

SVDq (arXiv 2502.15304) fits its basis to *pre-RoPE* keys: RoPE rotates pairs of channels by
position-dependent angles, which spreads a key's energy over more directions and flattens the
singular spectrum the method relies on. mlx-lm applies RoPE before the cache sees a key, so
the codec un-rotates each key at its absolute position and re-rotates reconstructed keys there.

A RoPE is described by its angular frequencies ``theta`` (radians per position, one per rotated
channel pair), the number of rotated channels ``dims`` (the first ones of the head) and the
pair layout (``traditional``: pairs ``(2i, 2i+1)``; otherwise ``(i, i + dims/2)``): all that
``mx.fast.rope`` uses. A constant factor some RoPEs apply to the rotated channels (the YaRN
and LongRoPE ``mscale``) commutes with the rotation, so un-rotating yields the scaled pre-RoPE
key, which spans the same subspace; it is not modelled.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np

__all__ = ["RopeSpec", "find_rope", "rope_spec", "rotate"]

_ATTENTION_NAMES = ("self_attn", "attention", "attn")
_ROPE_NAMES = ("rope", "rotary_emb")


@dataclass(frozen=True)
class RopeSpec:
    """Angular frequencies and layout of a RoPE.

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

    def same_as(self, other: RopeSpec) -> bool:
        return (
            self.dims == other.dims
            and self.traditional == other.traditional
            and np.allclose(self.theta, other.theta, rtol=1e-5, atol=0)
        )

    def describe(self) -> str:
        return f"dims={self.dims}, traditional={self.traditional}"


def rope_spec(rope: Any) -> RopeSpec:
    """The :class:`RopeSpec` of an MLX / mlx-lm RoPE module.

    Supports ``mlx.nn.RoPE`` and mlx-lm's ``Llama3RoPE``, ``YarnRoPE``, ``SuScaledRoPE``
    (LongRoPE) and ``ProportionalRoPE`` (fixed frequencies, read from ``_freqs``).

    Raises:
        TypeError: for other classes, including ``DynamicNTKScalingRoPE``, whose base depends
            on the sequence length at the time each key was computed.
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
    if isinstance(rope, ru.DynamicNTKScalingRoPE):
        raise TypeError(
            "svdq: DynamicNTKScalingRoPE changes its base with the sequence length, so a "
            "cached key cannot be un-rotated from its position alone; use pre_rope=False"
        )
    raise TypeError(
        f"svdq: unsupported RoPE class {type(rope).__module__}.{type(rope).__name__}; "
        "supported: mlx.nn.RoPE, mlx_lm rope_utils Llama3RoPE, YarnRoPE, SuScaledRoPE, "
        "ProportionalRoPE (or use pre_rope=False)"
    )


def find_rope(model: Any, layer: int) -> Any:
    """The RoPE module of attention layer ``layer`` of an mlx-lm model
    (``model.layers[layer].<self_attn|attention|attn>.<rope|rotary_emb>``).

    Raises:
        ValueError: when the model has no such layer or module.
    """
    layers = getattr(model, "layers", None)
    if layers is None or not 0 <= layer < len(layers):
        raise ValueError(f"svdq: the model has no layer {layer} to read the RoPE from")
    block = layers[layer]
    for a in _ATTENTION_NAMES:
        attn = getattr(block, a, None)
        for r in _ROPE_NAMES:
            rope = getattr(attn, r, None) if attn is not None else None
            if rope is not None:
                return rope
    raise ValueError(
        f"svdq: layer {layer} ({type(block).__name__}) has no attention RoPE module "
        f"(looked for {'/'.join(_ATTENTION_NAMES)}.{'/'.join(_ROPE_NAMES)}); "
        "pass rope_base=... or use pre_rope=False"
    )


def rotate(x: mx.array, positions: mx.array, spec: RopeSpec, inverse: bool = False) -> mx.array:
    """Apply RoPE (or its inverse) at arbitrary absolute positions, from cos/sin tables.

    Shapes:
        x ``(B, H, T, D)``; positions broadcastable to ``(B, H, T)`` integers (e.g.
        ``(B, 1, T)``); returns float32 ``(B, H, T, D)``.
    """
    x = x.astype(mx.float32)
    d, half = spec.dims, spec.dims // 2
    angles = positions.astype(mx.float32)[..., None] * mx.array(spec.theta)
    cos, sin = mx.cos(angles), mx.sin(angles)
    if inverse:
        sin = -sin
    rest = x[..., d:]
    if spec.traditional:
        pairs = x[..., :d].reshape(*x.shape[:-1], half, 2)
        x1, x2 = pairs[..., 0], pairs[..., 1]
        rot = mx.stack([x1 * cos - x2 * sin, x1 * sin + x2 * cos], axis=-1)
        rot = rot.reshape(*x.shape[:-1], d)
    else:
        x1, x2 = x[..., :half], x[..., half:d]
        rot = mx.concatenate([x1 * cos - x2 * sin, x1 * sin + x2 * cos], axis=-1)
    return rot if rest.shape[-1] == 0 else mx.concatenate([rot, rest], axis=-1)
