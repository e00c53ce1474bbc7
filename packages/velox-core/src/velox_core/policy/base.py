"""Retention policies: which tokens a cache keeps. A policy never sees how tokens are stored.

A :class:`RetentionPolicy` is attached to one :class:`~velox_core.cache.VeloxCache`. The cache
calls :meth:`observe` with the queries of every attention call (for policies that score
tokens by attention) and :meth:`after_update` after every store; the policy answers with
:meth:`VeloxCache.evict` calls naming the tokens to keep. What it fits or accumulates is its
state, saved with the cache.
"""

from __future__ import annotations

from typing import Any, ClassVar

import mlx.core as mx

__all__ = ["RetentionPolicy"]


class RetentionPolicy:
    """Base class: keeps every token. Subclasses override the hooks they need."""

    name: ClassVar[str] = "keep-all"

    def config(self) -> dict[str, Any]:
        return {}

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> RetentionPolicy:
        return cls(**config)

    def fresh(self) -> RetentionPolicy:
        return type(self).from_config(self.config())

    def describe(self) -> str:
        args = ",".join(f"{k}={v}" for k, v in self.config().items())
        return f"{self.name}({args})"

    def attach(self, cache) -> None:
        """Called once by the cache that owns this policy."""

    def bind(self, model: Any = None, layer: int | None = None) -> None:
        """Called by ``make_cache`` with the model and the layer index."""

    def observe(self, cache, queries: mx.array, scale: float) -> None:
        """Called with the (post-RoPE) queries of every attention call, before attention."""

    def after_update(self, cache, start: int) -> None:
        """Called after tokens ``[start, cache.offset)`` were stored."""

    def state(self) -> dict[str, mx.array]:
        return {}

    def meta(self) -> Any:
        """JSON-serializable scalars of the state."""
        return None

    def set_state(self, state: dict[str, mx.array], meta: Any) -> None:
        if state:
            raise ValueError(f"{self.name}: this policy has no state, got {sorted(state)}")

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.state().values())
