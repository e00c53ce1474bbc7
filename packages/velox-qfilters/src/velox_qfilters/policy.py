"""``QFiltersPolicy``: keep the keys with the largest projection on their head's Q-Filter.

Q-Filters (Godey et al., arXiv 2503.02812) observe that the post-RoPE queries of a head
share one dominant direction ``u`` (unit, oriented so most queries project positively on it)
and that, over queries, ``E[<q, k>] ≈ ||E[q]|| <u, k>``: the projection of a key on ``u``
estimates the attention logit it will receive. ``u`` is fitted once per model on
calibration text (:func:`velox_qfilters.fit_filters`); at run time a key's score is
``<f, k>`` with ``f`` its KV head's filter, and each head keeps its ``budget`` best keys
(sinks and the recent window are always kept). No query and no attention weight is needed,
so the policy works with any attention kernel, routed or not.

Filters come from an artifact (:mod:`velox_qfilters.artifact`): ``bind(model, layer)`` (called
by ``velox_core.make_cache``) finds the file fitted for the model (``filters=PATH`` wins,
checked against the model's fingerprint; else ``$VELOX_ARTIFACTS`` and ``~/.cache/velox``)
and raises if there is none. The layer's ``(H_kv, D)`` filters are read when the cache first
receives tokens; from then on they are the policy's state (saved with the cache, counted in
``nbytes``). Without a model, ``filters=PATH`` and ``layer=i`` name them directly.

Deviations from the paper: eviction runs after prefill chunks and every ``every`` decode
steps (the authors' cache evicts at every step once full); with ``bits`` set, keys are scored
from their stored (quantized) values.
"""

from __future__ import annotations

import os
from typing import Any

import mlx.core as mx

from velox_core import RetentionPolicy
from velox_core.validation import check_int

from .artifact import load_cached, resolve_filters

__all__ = ["QFiltersPolicy"]


class QFiltersPolicy(RetentionPolicy):
    """Evict the keys with the smallest projection on their head's Q-Filter.

    Args:
        budget: tokens kept per KV head (sinks + body + window).
        every: during decode, evict once the cache holds ``budget + every`` tokens.
        filters: path of a Q-Filters artifact (None: found by the model's fingerprint).
        layer: the model layer whose filters to use (set by ``bind``).
    """

    name = "qfilters"
    settings = ("filters", "layer")

    def __init__(
        self,
        budget: int = 1024,
        every: int | None = 32,
        filters: str | os.PathLike | None = None,
        layer: int | None = None,
    ):
        super().__init__(budget=check_int("budget", budget, minimum=1), every=every)
        if filters is not None and not isinstance(filters, (str, os.PathLike)):
            raise TypeError(f"filters must be a path or None, got {type(filters).__name__}")
        self.filters = None if filters is None else os.fspath(filters)
        self.layer = None if layer is None else check_int("layer", layer, minimum=0)
        self._path = self.filters
        self._f: mx.array | None = None

    def bind(self, model: Any = None, layer: int | None = None) -> None:
        """Find the artifact fitted for ``model`` (raises if none) and use its ``layer``."""
        if layer is not None:
            self.layer = check_int("layer", layer, minimum=0)
        if model is None:
            return
        path = resolve_filters(model, self.filters)
        if self.layer is not None:
            load_cached(path).layer(self.layer)  # fail now if the layer was not fitted
        self._path, self._f = str(path), None

    # -- filters ---------------------------------------------------------------------------
    def _read(self) -> mx.array:
        """The filters, read from the artifact the first time: from then on they are part of
        the policy's state (a copy or a saved file carries them, not the path found here)."""
        if self._f is None:
            if self._path is None or self.layer is None:
                raise ValueError(
                    "qfilters: no filters for this cache; make caches with "
                    "velox_core.make_cache(model, ...) (which finds the artifact fitted for the "
                    "model), or pass filters=PATH and layer=i"
                )
            self._f = load_cached(self._path).layer(self.layer)
        return self._f

    def _filters(self, view) -> mx.array:
        self._read()
        h, d = view.kv_heads, view.key_dim
        if tuple(self._f.shape) != (h, d):
            raise ValueError(
                f"qfilters: the filters of layer {self.layer} are {tuple(self._f.shape)} but the "
                f"cache holds {h} KV heads of dimension {d}: they were fitted for another model"
            )
        return self._f

    def before_update(self, view, incoming: int) -> None:
        self._filters(view)  # read once the cache holds tokens: part of its state from then on
        super().before_update(view, incoming)

    def defer(self) -> None:
        # a prompt's chunk stored with its cut deferred (prefill="prompt"): the cache holds
        # tokens, so the filters join the state now, as before_update reads them otherwise
        self._read()
        super().defer()

    def score(self, view) -> list[mx.array | None]:
        """Per KV head ``h``, ``<f_h, k>`` of each body key: ``(B, T_h)`` float32."""
        f = self._filters(view)
        return [None if k is None else k[:, 0] @ f[h] for h, k in enumerate(view.body_keys())]

    # -- state -------------------------------------------------------------------------------
    def state(self) -> dict[str, mx.array]:
        return {} if self._f is None else {"filters": self._f}

    def meta(self) -> Any:
        return {**super().meta(), "layer": self.layer}

    def set_state(self, state: dict[str, mx.array], meta: Any) -> None:
        extra = sorted(set(state) - {"filters"})
        if extra:
            raise ValueError(f"qfilters: unexpected policy state {extra}")
        f = state.get("filters")
        if f is not None and (f.ndim != 2 or f.dtype != mx.float32):
            raise ValueError(f"qfilters: filters must be float32 (H_kv, D), got {f.shape}")
        super().set_state({}, meta)
        self._f = f
        layer = (meta or {}).get("layer")
        if layer is not None:
            self.layer = check_int("layer", layer, minimum=0)
