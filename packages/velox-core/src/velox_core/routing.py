"""Whether attention is routed to velox caches: the state ``velox_core.routed`` (and
``enable`` / ``disable`` in :mod:`velox_core.router`) keeps and sets on every live cache.

A module of its own so that the caches register here without importing the attention
router (which imports the caches). Routing nests: it stays on until as many
:func:`leave` calls as :func:`enter` calls. Each velox cache calls :func:`track` when it is
made (copies and deep copies too, which are made through ``from_state``); its ``routed``
attribute is then True exactly while routing is on, set here when routing turns on or off,
so a cache's own calls (``update_and_fetch``) read their attribute, never this module.
"""

from __future__ import annotations

import weakref

__all__: list[str] = []

_depth = 0
_live: weakref.WeakSet = weakref.WeakSet()  # every velox cache alive, weakly


def _set_all(on: bool) -> None:
    for cache in list(_live):
        cache.routed = on


def track(cache) -> None:
    """Register ``cache``: its ``routed`` attribute is set now and whenever routing turns
    on or off."""
    cache.routed = _depth > 0
    _live.add(cache)


def enter() -> int:
    """One more level of routing; returns the depth now."""
    global _depth
    _depth += 1
    if _depth == 1:
        _set_all(True)
    return _depth


def leave() -> int:
    """One level less (never below 0); returns the depth now (0: routing is off)."""
    global _depth
    if _depth == 0:
        return 0
    _depth -= 1
    if _depth == 0:
        _set_all(False)
    return _depth


def is_enabled() -> bool:
    """Whether attention is routed now."""
    return _depth > 0
