"""``MergedStates``: a layer's view of its pair's merged tokens, for attention.

A layer's merged segment is a ``Packed`` record of ``e`` ``(B, H, T, D)`` (the pair's shared
directions, stored once for both layers) and ``m`` ``(B, H, T)`` (this layer's magnitudes);
the codec object carries the layer's retained tokens: their positions ``(N, 2)`` int32
(``(b * H + h, t)``, shared by the pair) and this layer's own vectors ``(N, D)``. Attention
restores the layer's states per call, ``m * e`` with the retained rows put back (the paper's
rescale and retention recovery); the restored tensor is transient, never kept.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx

from velox_core import Codec, Packed

from .merge import restore

__all__ = ["MergedStates"]


class MergedStates(Codec):
    """Restores one layer's keys or values from its pair's merged record.

    Args:
        pos: retained rows ``(N, 2)`` int32, ``(b * H + h, t)`` with ``t`` below the record's
            tokens, or None.
        rows: this layer's retained vectors ``(N, D)`` (storage dtype), or None.
    """

    name = "minicache-merged"

    def __init__(self, pos: mx.array | None = None, rows: mx.array | None = None):
        if (pos is None) != (rows is None):
            raise ValueError("MergedStates: pass both pos and rows, or neither")
        self.pos, self.rows = pos, rows

    def config(self) -> dict[str, Any]:
        return {}

    def encode(self, x: mx.array, positions: mx.array | None = None) -> Packed:
        raise TypeError(
            "minicache: merged states are made by the layer pair (MergedPair.merge_pending) "
            "from both layers' tokens, not encoded per layer"
        )

    def decode(self, packed: Packed) -> mx.array:
        """``m * e`` with the retained rows restored: float32 ``(B, H, T, D)``."""
        x = restore(packed.data["e"], packed.data["m"])
        if self.pos is None or self.pos.shape[0] == 0:
            return x
        b, h, t, d = x.shape
        flat = x.reshape(b * h * t, d)
        flat[self.pos[:, 0] * t + self.pos[:, 1]] = self.rows.astype(mx.float32)
        return flat.reshape(b, h, t, d)
