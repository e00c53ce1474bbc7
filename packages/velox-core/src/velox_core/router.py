"""The attention router: mlx-lm's shared attention pointed at velox caches, and the probe
that finds which layers it can serve.

mlx-lm models call the shared ``scaled_dot_product_attention`` of ``mlx_lm.models.base``,
imported by name into each model module. :func:`enable` points that name, in every loaded
``mlx_lm.models`` module that uses it, at a router that sends layers whose cache is a
:class:`VeloxCache` to :meth:`VeloxCache.attend` (attention from the codes), offers the
calls of layers whose cache is a :class:`~velox_core.cache.latent.LatentCache` to
:meth:`LatentCache.attend <velox_core.cache.latent.LatentCache.attend>` (multi-head latent
attention's decode step, from the latent's codes) and sends every other call to the original
function. :func:`disable` restores the originals; :func:`routed` is the
context manager. Nothing is patched on import. Which caches see routing on is the state of
:mod:`velox_core.routing`. A registered host's models (:mod:`velox_core.hosts`) are routed
the same way through their library's own shared attention function.

:func:`layer_routes` runs a model once with recording caches under the router to find which
layers pass their cache's keys and values to the shared attention (a :class:`Route` per
layer); :func:`velox_core.make_cache` (:mod:`velox_core.mlx_lm`) reads it.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import KVCache

from . import routing
from .cache.batch import VeloxBatch
from .cache.latent import LatentCache
from .cache.velox import VeloxCache
from .hosts import MLX_LM, Host, host_of, hosts

__all__: list[str] = []


_patched: dict[str, Callable] = {}


def _original(module: str = MLX_LM.attention[0]) -> Callable | None:
    """The unrouted shared attention function of ``module`` (None: a host's module that is
    not loaded, so no model of it exists yet)."""
    mod = sys.modules.get(module)
    if mod is None:
        if module != MLX_LM.attention[0]:
            return None
        import mlx_lm.models.base as mod
    fn = getattr(mod, "scaled_dot_product_attention", None)
    return getattr(fn, "__velox_original__", fn)


def _make_router(original: Callable) -> Callable:
    def scaled_dot_product_attention(queries, keys, values, cache, scale, mask, sinks=None, **kw):
        if isinstance(cache, (VeloxCache, VeloxBatch)):
            return cache.attend(queries, scale=scale, mask=mask, sinks=sinks)
        if isinstance(cache, LatentCache):  # the absorbed decode step, from the codes
            out = cache.attend(queries, keys, values, scale=scale, mask=mask, sinks=sinks)
            if out is not None:
                return out
        if isinstance(cache, _Probe):
            cache.record(queries, keys, values)
        return original(
            queries, keys, values, cache=cache, scale=scale, mask=mask, sinks=sinks, **kw
        )

    scaled_dot_product_attention.__velox_original__ = original
    return scaled_dot_product_attention


def _patch_all(extra_modules: list[str]) -> None:
    for host in hosts(load=False).values():
        base, prefix = host.attention
        original = _original(base)
        if original is None:
            continue
        router = _make_router(original)
        names = [n for n in list(sys.modules) if n == base or n.startswith(prefix)]
        for name in {*names, *extra_modules}:
            mod = sys.modules.get(name)
            fn = getattr(mod, "scaled_dot_product_attention", None)
            if fn is None or name in _patched:
                continue
            if fn is original or getattr(fn, "__velox_original__", None) is original:
                _patched[name] = original
                mod.scaled_dot_product_attention = router


def enable(model: Any = None) -> None:
    """Route attention of velox-cached layers to :meth:`VeloxCache.attend`.

    Patches every loaded ``mlx_lm.models`` module (and every registered host's model
    modules, and the modules of ``model``'s layers) that uses its shared attention function.
    Calls nest: routing stays on until the matching number of :func:`disable` calls.
    """
    routing.enter()
    extra = []
    if model is not None:
        host_of(model)  # a host registered through an entry point is loaded now
    if model is not None and hasattr(model, "modules"):
        extra = sorted({type(m).__module__ for m in model.modules()})
    _patch_all(extra)


def disable() -> None:
    """Undo one :func:`enable`; the last one restores every original function."""
    if not routing.is_enabled():
        return
    if routing.leave() == 0:
        for name, original in _patched.items():
            mod = sys.modules.get(name)
            if mod is not None:
                mod.scaled_dot_product_attention = original
        _patched.clear()


@contextmanager
def routed(model: Any = None) -> Iterator[None]:
    """``with routed(model): ...`` enables routing for the block."""
    enable(model)
    try:
        yield
    finally:
        disable()


def _layer_count(model: Any) -> int:
    layers = getattr(model, "layers", None)
    if layers is None:
        raise ValueError("make_cache: the model has no .layers; is it an mlx-lm model?")
    return len(layers)


class _Probe(KVCache):
    """Stands in for a layer's ``KVCache`` while :func:`layer_routes` runs the model once: it
    records the shapes the layer's attention stores and what it then hands mlx-lm's shared
    attention function (the router calls :meth:`record`)."""

    def __init__(self) -> None:
        super().__init__()
        self.stored: tuple[tuple[int, ...], tuple[int, ...]] | None = None
        self.fetched: tuple[Any, Any] | None = None
        # one entry per shared-attention call made with this cache:
        # (query shape, keys are the fetched keys, values are the fetched values)
        self.calls: list[tuple[tuple[int, ...], bool, bool]] = []

    def update_and_fetch(self, keys, values):
        self.stored = (tuple(keys.shape), tuple(values.shape))
        self.fetched = super().update_and_fetch(keys, values)
        return self.fetched

    def record(self, queries, keys, values) -> None:
        fk, fv = self.fetched if self.fetched is not None else (None, None)
        self.calls.append((tuple(queries.shape), keys is fk, values is fv))


@dataclass(frozen=True)
class Route:
    """How ``make_cache`` treats one layer whose model cache is a plain ``KVCache``.

    Attributes:
        routed: its attention passes the keys and values its cache returns to mlx-lm's
            shared ``scaled_dot_product_attention``, with queries of the key dim: a velox
            cache there is attended from its codes (:meth:`VeloxCache.attend`).
        key_dim, value_dim: channels of the keys and values the layer stores (None where it
            stores none).
        reason: why the layer is not routed ("" where it is).
        kv_heads: KV heads the layer stores (None where it stores none): fewer than the
            model's on a model sharded by heads (``model.shard(group)``).
        latent: multi-head latent attention: the layer stores one head of a latent (the
            ``key_dim`` channels) and one of a RoPE key (``value_dim``) and attends with
            projections of them (a :class:`~velox_core.cache.latent.LatentCache` serves it).
    """

    routed: bool
    key_dim: int | None
    value_dim: int | None
    reason: str = ""
    kv_heads: int | None = None
    latent: bool = False


def layer_routes(model: Any) -> dict[int, Route]:
    """What each ``KVCache`` layer of ``model`` does with its cache, found by running the model
    once on two tokens and then one (a lazy graph: nothing is computed) with recording caches.

    A layer is routed when every shared-attention call it makes passes exactly the arrays its
    cache returned, with queries of the key dim. Multi-head latent attention (DeepSeek-V3 and
    the models built on its attention) stores a latent and a RoPE key but attends with
    projections of them, so it is not; a layer with its own attention code calls no shared
    attention. Cached on the model (the probe runs once per model). A host's model
    (:mod:`velox_core.hosts`) is probed through its language model; the keys are its layer indices.
    """
    host = host_of(model)
    lm = host.language_model(model)
    layers = getattr(lm, "layers", None)
    key = tuple(id(m) for m in layers) if layers is not None else ()
    known = getattr(lm, "__velox_routes__", None)
    if isinstance(known, _Routes) and known.key == key:
        return known.routes
    native = _native_caches(lm, host)
    probes = [_Probe() if host.is_plain(c) else c for c in native]
    with routed(model):
        host.run_probe(lm, mx.array([[0, 0]], dtype=mx.int32), probes)
        host.run_probe(lm, mx.array([[0]], dtype=mx.int32), probes)
    routes = {i: _verdict(p) for i, p in enumerate(probes) if isinstance(p, _Probe)}
    lm.__velox_routes__ = _Routes(key, routes)
    return routes


@dataclass(frozen=True)
class _Routes:
    key: tuple[int, ...]  # ids of the model's layer modules when probed
    routes: dict[int, Route]
    warned: list = field(default_factory=list)  # warnings already given, once per model


_OWN_ATTENTION = "its attention does not call mlx-lm's shared scaled_dot_product_attention"


def _verdict(p: _Probe) -> Route:
    if p.stored is None:
        return Route(False, None, None, "its attention stores nothing in its own cache")
    (kshape, vshape) = p.stored
    kd, vd = kshape[-1], vshape[-1]
    heads = kshape[1]
    if not p.calls:
        return Route(False, kd, vd, _OWN_ATTENTION, heads)
    for qshape, same_k, same_v in p.calls:
        if not (same_k and same_v):
            return Route(
                False,
                kd,
                vd,
                f"its cache stores keys of {kshape[1]} head(s) x {kd} channels and values of "
                f"{vshape[1]} head(s) x {vd}, but its attention is given other arrays (multi-head "
                "latent attention stores a latent and a RoPE key and attends with projections)",
                heads,
                latent=kshape[1] == 1 and vshape[1] == 1,
            )
        if qshape[-1] != kd:
            return Route(
                False, kd, vd, f"its queries have {qshape[-1]} channels, its keys {kd}", heads
            )
    return Route(True, kd, vd, "", heads)


def _native_caches(model: Any, host: Host = MLX_LM) -> list:
    """The caches the (language) model's own class makes (mlx-lm's ``make_prompt_cache``
    without the override set by :func:`install`): its ``make_cache`` where the class has one,
    else the host's plain KV cache per layer."""
    own = getattr(type(model), "make_cache", None)
    if own is not None:
        return own(model)
    return [host.plain_cache() for _ in range(_layer_count(model))]
