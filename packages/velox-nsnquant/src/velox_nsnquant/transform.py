"""NSNQuant's normalize-shift-normalize transform and its Hadamard rotation.

NSNQuant (arXiv 2505.18231) brings each token close to the standard normal law in three steps
and a rotation:

1. **Normalize** (token-wise): ``x1 = x / s1`` with ``s1 = ||x|| / sqrt(D)``;
2. **Shift** (channel-wise centering): ``x2 = x1 - o``, ``o`` the mean of ``x1`` over a block
   of ``G`` tokens (its own statistics: nothing is calibrated);
3. **Normalize** again: ``x3 = x2 / s2`` with ``s2 = ||x2|| / sqrt(D)``;
4. **Hadamard**: ``y = H x3``, which spreads each token over its channels so that the
   coordinates of ``y`` follow ``N(0, 1)`` closely (``||y||^2 = D``).

So ``x = s1 (s2 H^T y + o)``, and in the rotated domain ``H x = s1 s2 y + s1 (H o)``.

``H`` is the normalized Sylvester Hadamard matrix (block-diagonal, Sylvester blocks of the
largest power of two dividing ``D``, where ``D`` is not a power of two); with a ``seed`` it is
velox-core's randomized Hadamard (seeded signs) instead, an option.
"""

from __future__ import annotations

import mlx.core as mx

from velox_core.ops import HadamardRotation

__all__ = ["Rotation", "nsn"]

_TINY = 1e-12  # the norm below which a token counts as zero


Rotation = HadamardRotation  # velox-core's: the Sylvester matrix, or seeded signs


def _norm(x: mx.array) -> mx.array:
    """``||x|| / sqrt(D)`` per token, at least ``_TINY``: float32 ``(..., 1)``."""
    d = x.shape[-1]
    return mx.maximum(mx.sqrt(mx.sum(x * x, axis=-1, keepdims=True) / d), _TINY)


def nsn(x: mx.array, group: int) -> tuple[mx.array, mx.array, mx.array, mx.array]:
    """The normalize-shift-normalize transform of blocks of ``group`` tokens.

    Shapes:
        x ``(B, H, T, D)`` with ``T`` a multiple of ``group``; returns float32 ``x3`` ``(B, H,
        T, D)`` (``||x3||^2 = D`` per token, before the rotation), ``s1`` and ``s2`` ``(B, H,
        T, 1)`` and the block means ``o`` ``(B, H, T / group, D)``, with
        ``x = s1 (s2 x3 + o)``.
    """
    b, h, t, d = x.shape
    x = x.astype(mx.float32)
    s1 = _norm(x)
    x1 = (x / s1).reshape(b, h, t // group, group, d)
    o = mx.mean(x1, axis=-2, keepdims=True)
    x2 = (x1 - o).reshape(b, h, t, d)
    s2 = _norm(x2)
    return x2 / s2, s1, s2, o.squeeze(-2)
