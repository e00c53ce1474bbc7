"""Codecs: ``(B, H, T, D)`` vectors to packed records and back, with compressed attention."""

from .base import Codec, Packed
from .identity import Identity
from .uniform import Uniform

__all__ = ["Codec", "Identity", "Packed", "Uniform"]
