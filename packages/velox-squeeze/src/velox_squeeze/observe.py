"""The hidden states around each attention block, observed in an mlx-lm model.

SqueezeAttention's importance is the cosine between the residual stream entering a decoder
layer's attention block and the one leaving it. mlx-lm's decoder layers compute it inline::

    r = self.self_attn(self.input_layernorm(x), mask, cache)
    h = x + r                                   # Gemma 3: x + post_attention_layernorm(r)

and neither ``x`` nor ``h`` reaches a cache: the cache sees keys, values and (through velox's
routed attention) queries only. So :func:`install` gives each decoder layer, and its
``self_attn``, a subclass of its own class whose ``__call__`` observes and then runs the
original (the instance's class is swapped: no module is replaced, the parameter tree, the
weights and every attribute stay as they were, and :func:`uninstall` swaps the classes
back). The layer's wrapper notes ``x`` and the cache it is given; the attention's wrapper
takes ``r`` when the original returns it, forms ``h`` as the model does (:data:`RESIDUALS`:
the residual of each supported model type) and hands each token's ``cos(x, h)`` (float32) to
the cache's :class:`~velox_squeeze.SqueezePolicy` (each group's rows and real tokens, for
mlx-lm's batched caches). Only multi-token calls (prefill chunks) are observed, as the paper
measures the prompt: a decode step costs two Python calls and a type check per layer.

Once the model's last layer has run a multi-token forward, the observer decides the
allocation (:func:`~velox_squeeze.allocate.places`) of every sequence, from the mean cosines
of every layer that holds a squeeze cache in that forward, and gives each layer's policy its
place. Layers without one (a sliding-window layer's own cache, another method) pass through.
``make_cache`` installs it (through the policy's ``bind``); it is installed once per model.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx

from velox_core import VeloxBatch, VeloxCache

from .allocate import places

__all__ = ["RESIDUALS", "Observer", "install", "installed", "uninstall"]

# mlx-lm 0.32 model types whose decoder layers run ``r = self.self_attn(
# self.input_layernorm(x), mask, cache)``, and how their residual stream adds ``r``
RESIDUALS: dict[str, str] = {
    "llama": "x + r",
    "mistral": "x + r",
    "qwen2": "x + r",
    "qwen3": "x + r",
    "phi3": "x + r",
    "gemma3_text": "x + post_attention_layernorm(r)",
}


def _model_type(model: Any) -> str | None:
    t = getattr(model, "model_type", None)
    if t is None:
        t = getattr(getattr(model, "args", None), "model_type", None)
    return t if isinstance(t, str) else None


def _policy(cache: Any):
    """The policy of a velox cache that takes layer importance (a
    :class:`~velox_squeeze.SqueezePolicy`: ``add_importance``, ``row_importance`` and
    ``place``), or None."""
    pol = cache.policy if isinstance(cache, VeloxCache) else None
    return pol if callable(getattr(pol, "add_importance", None)) else None


def _watched(cache: Any) -> bool:
    """Whether ``cache`` is, or (batched) holds, a squeeze cache."""
    if isinstance(cache, VeloxBatch):
        return any(_policy(g) is not None for g in cache.groups)
    return _policy(cache) is not None


def _units(cache: Any, rows: int) -> list[tuple[Any, int, int, tuple[int, int] | None]]:
    """``(policy, r0, r1, tokens)`` for each squeeze cache in ``cache`` (of ``rows`` batch
    rows): itself, or each group of a batched cache with its rows and the token range of the
    newest update's input it stored (None: all of it)."""
    if isinstance(cache, VeloxBatch):
        out = []
        for g, (r0, r1), tokens in cache.parts():
            pol = _policy(g)
            if pol is not None:
                out.append((pol, r0, r1, tokens))
        return out
    pol = _policy(cache)
    return [] if pol is None else [(pol, 0, rows, None)]


def _rows(cache: Any) -> int:
    if isinstance(cache, VeloxBatch):
        return cache.batch_size
    return 0 if cache.stored.dims is None else cache.stored.dims[0]


class Observer:
    """One model's observer: what the wrappers of its layers share during a forward.

    Args:
        n_layers: the model's decoder layers (the allocation is decided after the last).
        residual: how the model's residual stream adds the attention output
            (:data:`RESIDUALS`).
    """

    def __init__(self, n_layers: int, residual: str):
        self.n_layers = n_layers
        self.residual = residual
        self.current: tuple[mx.array, Any, Any] | None = None  # (x, cache, layer) in a block
        self.seen: list[tuple[int, Any]] = []  # this forward's observed layers and caches
        self.last = -1  # the index of the last layer entered
        self.took = False  # the current layer's cosines were handed to a cache

    # -- the wrappers' calls ------------------------------------------------------------------
    def enter(self, index: int, layer: Any, x: mx.array, cache: Any) -> None:
        if index <= self.last:  # a new forward (the previous one stopped early)
            self.seen.clear()
        self.last = index
        self.current, self.took = None, False
        if getattr(x, "ndim", 0) == 3 and x.shape[1] > 1 and _watched(cache):
            self.current = (x, cache, layer)

    def leave(self, index: int, cache: Any, observed: bool) -> None:
        self.current = None
        if observed:
            self.seen.append((index, cache))
        if index == self.n_layers - 1:
            self.last = -1
            seen, self.seen = self.seen, []
            if seen:
                decide(seen)

    def record(self, r: mx.array) -> None:
        """Hand the layer's per-token cosines to its caches (``took``: whether one did)."""
        x, cache, layer = self.current
        self.current = None
        delta = layer.post_attention_layernorm(r) if self.residual != "x + r" else r
        xf = x.astype(mx.float32)
        h = xf + delta.astype(mx.float32)
        dot = mx.sum(xf * h, axis=-1)
        norms = mx.linalg.norm(xf, axis=-1) * mx.linalg.norm(h, axis=-1)
        cos = dot / mx.maximum(norms, 1e-30)  # (B, N)
        for pol, r0, r1, tokens in _units(cache, cos.shape[0]):
            a, e = (0, cos.shape[1]) if tokens is None else tokens
            if e > a:
                pol.add_importance(cos[r0:r1, a:e])
                self.took = True


def decide(seen: list[tuple[int, Any]]) -> None:
    """Give every squeeze cache of a forward its layer's place, for its rows: the layers'
    mean cosines (over its rows' observed tokens, averaged over its rows) clustered."""
    layers = sorted({i for i, _ in seen})
    means: dict[int, list[float | None]] = {}
    units = {i: _units(c, _rows(c)) for i, c in seen}
    for i in layers:
        rows: dict[int, float | None] = {}
        for pol, r0, r1, _ in units[i]:
            imp = pol.row_importance() or [None] * (r1 - r0)
            for b in range(r0, r1):
                rows[b] = imp[b - r0]
        means[i] = [rows.get(b) for b in range(max(rows, default=-1) + 1)]
    decided: dict[tuple[int, int], list | None] = {}
    for i in layers:
        for pol, r0, r1, _ in units[i]:
            key = (r0, r1)
            if key not in decided:
                vec = []
                for j in layers:
                    vals = means[j][r0:r1] if len(means[j]) >= r1 else []
                    if len(vals) != r1 - r0 or any(v is None for v in vals):
                        vec = None
                        break
                    vec.append(sum(vals) / len(vals))
                decided[key] = None if vec is None else places(vec)
            where = decided[key]
            if where is not None:
                pol.place = where[layers.index(i)]


# -- installing ---------------------------------------------------------------------------------
class _Tap:
    """What a wrapped module knows: its model's observer and (a decoder layer) its index."""

    def __init__(self, observer: Observer, index: int):
        self.observer, self.index = observer, index


_LAYER_CLASSES: dict[type, type] = {}
_ATTN_CLASSES: dict[type, type] = {}


def _layer_class(base: type) -> type:
    if base not in _LAYER_CLASSES:

        def __call__(self, x, *args, **kwargs):
            tap = self.__dict__.get("_velox_squeeze")
            if tap is None:
                return base.__call__(self, x, *args, **kwargs)
            cache = kwargs["cache"] if "cache" in kwargs else (args[1] if len(args) > 1 else None)
            obs = tap.observer
            obs.enter(tap.index, self, x, cache)
            try:
                out = base.__call__(self, x, *args, **kwargs)
            finally:
                obs.current = None
            obs.leave(tap.index, cache, obs.took)
            return out

        _LAYER_CLASSES[base] = _wrapped(base, __call__)
    return _LAYER_CLASSES[base]


def _attn_class(base: type) -> type:
    if base not in _ATTN_CLASSES:

        def __call__(self, x, *args, **kwargs):
            out = base.__call__(self, x, *args, **kwargs)
            tap = self.__dict__.get("_velox_squeeze")
            if tap is not None and tap.observer.current is not None:
                tap.observer.record(out)
            return out

        _ATTN_CLASSES[base] = _wrapped(base, __call__)
    return _ATTN_CLASSES[base]


def _wrapped(base: type, call) -> type:
    cls = type(base.__name__, (base,), {"__call__": call, "__velox_squeeze_base__": base})
    cls.__module__ = base.__module__  # velox's routing patches the modules of layer classes
    cls.__qualname__ = base.__qualname__
    return cls


def installed(model: Any) -> Observer | None:
    """The model's observer, if :func:`install` put one on it."""
    obs = model.__dict__.get("__velox_squeeze__") if hasattr(model, "__dict__") else None
    return obs if isinstance(obs, Observer) else None


def install(model: Any) -> Observer:
    """Observe ``model``'s decoder layers (idempotent: once per model).

    Raises:
        ValueError: the model's type is not one of :data:`RESIDUALS`, or its layers lack
            ``self_attn`` (the attention block observed).
    """
    layers = getattr(model, "layers", None)
    obs = installed(model)
    if (
        obs is not None
        and layers is not None
        and obs.n_layers == len(layers)
        and all(type(m).__dict__.get("__velox_squeeze_base__") for m in layers)
    ):
        return obs
    kind = _model_type(model)
    if kind not in RESIDUALS or layers is None:
        raise ValueError(
            f"squeeze: cannot observe a model of type {kind!r}: its layer importance is the "
            "cosine of the hidden states around each attention block, read from decoder "
            f"layers of a known form; supported model types: {', '.join(RESIDUALS)}"
        )
    missing = [i for i, m in enumerate(layers) if not hasattr(m, "self_attn")]
    if missing:
        raise ValueError(
            f"squeeze: the {kind} model's layers {missing} have no self_attn to observe"
        )
    obs = Observer(len(layers), RESIDUALS[kind])
    for i, layer in enumerate(layers):
        _swap(layer, _layer_class, _Tap(obs, i))
        _swap(layer.self_attn, _attn_class, _Tap(obs, i))
    object.__setattr__(model, "__velox_squeeze__", obs)
    return obs


def _swap(module: Any, make, tap: _Tap) -> None:
    base = type(module).__dict__.get("__velox_squeeze_base__") or type(module)
    module.__class__ = make(base)
    object.__setattr__(module, "_velox_squeeze", tap)


def uninstall(model: Any) -> None:
    """Give ``model``'s layers their own classes back (no-op where nothing is installed)."""
    for layer in getattr(model, "layers", None) or []:
        for m in (layer, getattr(layer, "self_attn", None)):
            base = type(m).__dict__.get("__velox_squeeze_base__") if m is not None else None
            if base is not None:
                m.__class__ = base
                m.__dict__.pop("_velox_squeeze", None)
    if installed(model) is not None:
        object.__delattr__(model, "__velox_squeeze__")
