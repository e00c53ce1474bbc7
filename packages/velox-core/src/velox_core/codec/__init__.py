"""Codecs: ``(B, H, T, D)`` vectors to packed records and back, with compressed attention."""

__all__: list[str] = []
