"""The lossless codec: tokens kept as given (fp16, bf16 or fp32). Used for sinks and windows."""

from __future__ import annotations

from typing import Any

import mlx.core as mx

from .base import Codec, Packed

__all__: list[str] = []


class Identity(Codec):
    """Keeps vectors unchanged in their input dtype; ``decode`` returns them as stored."""

    name = "fp16"
    decodes_slices = True  # every token stored as given

    def config(self) -> dict[str, Any]:
        return {}

    def encode(self, x: mx.array, positions: mx.array | None = None) -> Packed:
        return Packed({"x": x}, x.shape[2])

    def decode(self, packed: Packed) -> mx.array:
        return packed.data["x"]
