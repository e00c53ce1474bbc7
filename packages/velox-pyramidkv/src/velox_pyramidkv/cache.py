"""``PyramidKVCache``: PyramidKV's eviction (optionally with ``Uniform`` codes of the kept tokens).

The cache is a :class:`velox_core.VeloxCache` with a :class:`~velox_pyramidkv.PyramidKVPolicy`:
after each prefill chunk (and, with ``every``, during decode) the layer's stored tokens are
cut to *its* budget per KV head, keeping what the observation window votes for. The budget
depends on the layer's place in the pyramid, which ``velox_core.make_cache(model, ...)``
gives it: :meth:`bind` with the model layer, then :meth:`link_layers` with the rank among
the model's layers that hold a PyramidKV cache. The place is part of the cache's config, so
it is saved with the cache and ``fresh()`` copies it. Attention must be routed to the cache
(``velox_core.routed(model)`` or ``velox_core.generate``) for the policy to see the queries;
see :mod:`velox_pyramidkv.policy` for the mechanism and the deviations from the paper.
"""

from __future__ import annotations

from typing import Any

from velox_core.cache.eviction import EvictionCache
from velox_core.policy.voting import VOTE_PARAMS

from .config import PyramidKVConfig
from .policy import PyramidKVPolicy

__all__ = ["PyramidKVCache"]


class PyramidKVCache(EvictionCache):
    """PyramidKV's cache for one layer. Parameters: see :class:`PyramidKVConfig`."""

    method = "pyramidkv"
    Config = PyramidKVConfig
    Policy = PyramidKVPolicy
    policy_params = (*VOTE_PARAMS, "beta", "layer", "n_layers")

    def bind(self, model: Any = None, layer: int | None = None) -> None:
        """Place the cache among ``model``'s layers (the policy raises without a model unless
        ``n_layers`` is set)."""
        super().bind(model, layer)
        self._sync_place()

    def place(self, layer: int, n_layers: int) -> None:
        """Set the cache's place in the pyramid: ``0 <= layer < n_layers`` (0: the bottom)."""
        self.policy.place(layer, n_layers)
        self._sync_place()

    def _sync_place(self) -> None:
        self.cfg.layer, self.cfg.n_layers = self.policy.layer, self.policy.n_layers

    @classmethod
    def link_layers(cls, caches: list) -> None:
        """The pyramid spans the layers holding a PyramidKV cache, in model order: layers
        left to the model's own cache (sliding-window, linear attention) or given another
        method take no share, so these layers together keep ``len(pyramid) x budget``."""
        pyramid = [c for c in caches if isinstance(c, PyramidKVCache)]
        for rank, c in enumerate(pyramid):
            c.place(rank, len(pyramid))
