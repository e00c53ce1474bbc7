"""Reading velox's entry-point plugins (``velox.methods``, ``velox.hosts``)."""

from __future__ import annotations

import warnings
from collections.abc import Iterable
from typing import Any

__all__: list[str] = []


def load_plugins(eps: Iterable[Any], cls: type, call: bool = False) -> list[Any]:
    """The ``cls`` instances that the entry points ``eps`` give, in order (``call``: one may
    also give a function of no arguments returning one). An entry point that fails to load,
    or gives something else, is skipped with a ``RuntimeWarning`` naming it and the error: a
    broken plugin must not break the others."""
    found = []
    for ep in eps:
        try:
            obj = ep.load()
            if call and not isinstance(obj, cls):
                obj = obj()
            if not isinstance(obj, cls):
                raise TypeError(f"it gives a {type(obj).__name__}, not a velox_core {cls.__name__}")
        except Exception as e:
            warnings.warn(
                f"velox: skipping {cls.__name__.lower()} plugin {ep.name!r} ({ep.value}): {e}",
                RuntimeWarning,
                stacklevel=3,
            )
            continue
        found.append(obj)
    return found
