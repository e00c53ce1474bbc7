"""``Configured``: an object rebuilt from its constructor arguments (codecs, retention policies).

A codec or a policy saves nothing but its settings (:meth:`Configured.config`, JSON values)
and its fitted arrays; a saved cache rebuilds it with :meth:`Configured.from_config`, and a
cache makes one per layer with :meth:`Configured.fresh`.
"""

from __future__ import annotations

from typing import Any, ClassVar, TypeVar

__all__: list[str] = []

T = TypeVar("T", bound="Configured")


class Configured:
    """Settings as constructor arguments: ``type(obj)(**obj.config())`` is a fresh copy."""

    name: ClassVar[str]
    # the constructor arguments kept as attributes of the same names: what the default
    # config() returns (a class whose settings are not plain attributes defines config())
    settings: ClassVar[tuple[str, ...]] = ()

    def config(self) -> dict[str, Any]:
        """JSON-serializable constructor arguments: ``type(self)(**self.config())``."""
        if not self.settings:
            raise NotImplementedError(f"{type(self).__name__} must define config() or settings")
        return {name: getattr(self, name) for name in self.settings}

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
