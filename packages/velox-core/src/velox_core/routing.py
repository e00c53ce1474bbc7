"""Whether attention is routed to velox caches now: the state ``velox_core.routed`` (and
``enable`` / ``disable`` in :mod:`velox_core.mlx_lm`) keeps, read by the caches.

A module of its own so that the caches read it without importing the mlx-lm integration
(which imports the caches). Routing nests: it stays on until as many :func:`leave` calls as
:func:`enter` calls.
"""

from __future__ import annotations

__all__ = ["enter", "is_enabled", "leave"]

_depth = 0


def enter() -> int:
    """One more level of routing; returns the depth now."""
    global _depth
    _depth += 1
    return _depth


def leave() -> int:
    """One level less (never below 0); returns the depth now (0: routing is off)."""
    global _depth
    _depth = max(0, _depth - 1)
    return _depth


def is_enabled() -> bool:
    return _depth > 0
