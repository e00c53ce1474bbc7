"""``Configured``: an object rebuilt from its constructor arguments (codecs, retention policies).

A codec or a policy saves nothing but its settings (:meth:`Configured.config`, JSON values)
and its fitted arrays; a saved cache rebuilds it with :meth:`Configured.from_config`, and a
cache makes one per layer with :meth:`Configured.fresh`.
"""

from __future__ import annotations

from typing import Any, ClassVar, TypeVar

__all__ = ["Configured"]

T = TypeVar("T", bound="Configured")


class Configured:
    """Settings as constructor arguments: ``type(obj)(**obj.config())`` is a fresh copy."""

    name: ClassVar[str]

    def config(self) -> dict[str, Any]:
        """JSON-serializable constructor arguments: ``type(self)(**self.config())``."""
        raise NotImplementedError(f"{type(self).__name__} must define config()")

    @classmethod
    def from_config(cls: type[T], config: dict[str, Any]) -> T:
        return cls(**config)

    def fresh(self: T) -> T:
        """A copy with the same settings that has fitted and seen nothing (one per layer and
        per cache)."""
        return type(self).from_config(self.config())

    def describe(self) -> str:
        """``name(key=value,...)`` of the settings."""
        args = ",".join(f"{k}={v}" for k, v in self.config().items())
        return f"{self.name}({args})"
