"""Integration with mlx-lm: per-layer caches (:func:`make_cache`), installing them on a
model, and ``generate``.

:func:`make_cache` gives every full-attention layer of an mlx-lm model a velox cache, where
the attention router (:mod:`velox_core.router`: ``enable`` / ``disable`` / ``routed``) can
serve it, and keeps the model's own cache elsewhere. Another library whose models work as
mlx-lm's do registers a host (:mod:`velox_core.hosts`): ``make_cache`` and ``install`` then
serve its models too (its language model's layers, its own plain cache). Without routing a
velox cache still gives correct results: ``update_and_fetch`` returns the decoded keys and
values, which the model's own attention then uses (slower, and transiently fp16).
"""

from __future__ import annotations

from typing import Any

from .cache.latent import METHODS as LATENT_METHODS
from .cache.latent import LatentCache
from .cache.uniform import UniformCache
from .cache.velox import VeloxCache
from .hosts import MLX_LM, Host, host_of
from .registry import make, parse_spec
from .router import (
    _OWN_ATTENTION,
    Route,
    _layer_count,
    _native_caches,
    disable,
    enable,
    layer_routes,
    routed,
)
from .split import STAGE_LAST, split_refusal, stage_last_layer

__all__: list[str] = []


# mlx-lm model types (0.32; mistral runs the llama module) whose attention layers pass what
# update_and_fetch returns only to the shared scaled_dot_product_attention (with their cache)
# and share no keys across layers: under routing their velox caches need not build every
# stored token decoded each step (a host's own list: Host.routed_only)
ROUTED_ONLY_MODEL_TYPES = MLX_LM.routed_only


def _model_type(model: Any) -> str | None:
    t = getattr(model, "model_type", None)
    if t is None:
        t = getattr(getattr(model, "args", None), "model_type", None)
    return t if isinstance(t, str) else None


def _language_model(model: Any) -> tuple[Host, Any]:
    """``model``'s host and the language model whose layers get caches (:mod:`.hosts`)."""
    host = host_of(model)
    return host, host.language_model(model)


def _build(spec: Any, index: int, host: Host = MLX_LM) -> Any:
    if spec is None or spec == "fp16":
        return host.plain_cache()
    if isinstance(spec, VeloxCache):
        return spec.fresh()
    if isinstance(spec, str):
        return make(spec)
    if callable(spec):
        out = spec(index)
        if out is None:
            return host.plain_cache()
        return out
    raise TypeError(
        "a layer spec must be None/'fp16', a method spec string, a VeloxCache template or "
        f"a callable(layer_index) -> cache; got {type(spec).__name__}"
    )


def make_cache(
    model: Any,
    default: Any = "uniform",
    layers: dict[int, Any] | None = None,
    storage_dtype: Any = None,
) -> list:
    """A fresh list of per-layer caches for ``model``.

    Layers whose native cache is a plain ``KVCache`` get a velox cache from ``default`` or
    from ``layers[i]`` (negative indices count from the end); other layers (sliding-window,
    linear attention / SSM state) keep the model's own cache. So does a ``KVCache`` layer whose
    attention velox cannot serve (:func:`layer_routes`), with one warning per model naming the
    layers and why (on a model split into pipeline stages, so does each stage's last layer
    unless ``layers`` names a velox spec for it, which is refused); a layer with its own
    attention code (no call to mlx-lm's shared attention)
    keeps a velox cache only without a retention policy, whose attention reads the decoded
    tokens ``update_and_fetch`` returns.

    A multi-head latent attention layer (DeepSeek-V3, Kimi K2, GLM-4 MoE-lite: ``Route.latent``)
    gets a :class:`~velox_core.cache.latent.LatentCache` (its latent and RoPE key as packed
    affine codes, returned decoded; under routing its decode steps attend from the latent's
    codes) when its spec is a ``uniform`` spec string, a
    ``UniformCache`` template or a ``LatentCache`` template (the methods in
    ``velox_core.cache.latent.METHODS``); any other spec keeps the model's fp16 cache there,
    with the warning. A ``group`` that does not divide the latent or RoPE-key width, or
    per-channel groups, raise a ``ValueError`` naming the layer.

    Each velox cache is asked, before the first forward, whether it codes the key and value
    dims the layer stores (:meth:`VeloxCache.check_dims`): a ``ValueError`` naming the layer,
    the head dims and the method otherwise.

    Args:
        model: an mlx-lm model, or a model of a registered host (:mod:`velox_core.hosts`:
            mlx-vlm's with velox-vlm installed), whose language model's layers get the caches.
        default: spec for every full-attention layer: a method spec string
            (``"uniform:bits=4"``), a :class:`VeloxCache` used as a template (cloned per
            layer), a callable ``layer_index -> cache``, or None / ``"fp16"`` for mlx-lm's KVCache.
        layers: per-layer overrides, same spec types.
        storage_dtype: dtype velox caches keep unquantized tokens and scales in (default: the
            model's); e.g. ``mx.float16`` for a model computing in float32 on a CPU.

    Once every layer's cache is built and bound, each velox cache class is given the whole
    list (:meth:`VeloxCache.link_layers`), so that a method whose layers share state (a
    coordinator of a group of layers, as xKV's) can link them; ``load_cache`` does the same.

    For model types in :data:`ROUTED_ONLY_MODEL_TYPES` the caches get ``fetch_decoded =
    False``: while attention is routed, ``update_and_fetch`` returns the new tokens instead
    of building every stored token decoded, which only the model's own attention would read
    (without routing it still returns them decoded).
    """
    host, lm = _language_model(model)
    n = _layer_count(lm)
    native = _native_caches(lm, host)
    if len(native) != n:
        raise ValueError(f"make_cache: the model made {len(native)} caches for {n} layers")
    overrides: dict[int, Any] = {}
    for k, spec in (layers or {}).items():
        if isinstance(k, bool) or not isinstance(k, int) or not -n <= k < n:
            raise ValueError(f"make_cache: layer index {k!r} out of range for {n} layers")
        overrides[k % n] = spec
    out = []
    routed_only = _model_type(lm) in host.routed_only
    routes: dict[int, Route] | None = None
    kept: dict[str, list[int]] = {}  # reason -> layers left to the model's own cache
    for i, c in enumerate(native):
        if not host.is_plain(c):
            out.append(c)
            continue
        spec = overrides.get(i, default)
        latent = _latent_spec(spec)
        if latent is not None:
            routes = layer_routes(model) if routes is None else routes
            if routes[i].latent:
                out.append(_latent_cache(latent, routes[i], i, storage_dtype))
                continue
            if isinstance(spec, LatentCache):
                raise ValueError(
                    f"make_cache: layer {i}: a LatentCache serves only multi-head latent "
                    "attention layers (DeepSeek-V3's); give this layer a velox spec"
                )
        cache = _build(spec, i, host)
        if isinstance(cache, VeloxCache):
            routes = layer_routes(model) if routes is None else routes
            route = routes[i]
            reason = _unserved(route, cache)
            if reason and route.latent:
                reason += (
                    f"; only {', '.join(sorted(LATENT_METHODS))} specs code a latent "
                    f"(velox_core.LatentCache), not {cache.method}"
                )
            if reason:
                kept.setdefault(reason, []).append(i)
                out.append(c)
                continue
            # split models (split.py): a pipeline stage's last layer keeps mlx-lm's cache
            # unless a velox spec was asked for it
            refusal = split_refusal(lm, i, route, cache, stage_last=i in overrides)
            if refusal:
                raise ValueError(f"make_cache: layer {i}: {refusal}")
            if stage_last_layer(lm, i):
                kept.setdefault(STAGE_LAST, []).append(i)
                out.append(c)
                continue
            cache.bind(lm, i)
            if route.key_dim is not None:  # refuse dims the method cannot code now
                try:
                    cache.check_dims(route.key_dim, route.value_dim, storage_dtype)
                except ValueError as exc:
                    dims = _dims_text(route)
                    raise ValueError(f"make_cache: layer {i} ({dims}): {exc}") from None
            if routed_only:
                cache.fetch_decoded = False
            if storage_dtype is not None:
                cache.set_storage_dtype(storage_dtype)
        out.append(cache)
    _link(out)
    if kept:
        _warn_kept(lm, kept)
    return out


def _latent_spec(spec: Any) -> Any:
    """What a multi-head latent attention layer's :class:`LatentCache` is made from: a
    ``LatentCache`` template, or ``(method, params)`` of a ``uniform`` spec string or
    ``UniformCache`` template; None for every other spec (the layer keeps its fp16 cache)."""
    if isinstance(spec, LatentCache):
        return spec
    if isinstance(spec, str) and spec != "fp16":
        name, params = parse_spec(spec)
        return (name, params) if name in LATENT_METHODS else None
    if type(spec) is UniformCache:
        import dataclasses

        # the template's flush (resolved to velox's default) is not carried: a LatentCache's
        # is 1 unless a spec string names one
        return (spec.method, {**dataclasses.asdict(spec.cfg), "check_finite": spec.check_finite})
    return None


def _latent_cache(latent: Any, route: Route, index: int, storage_dtype: Any) -> LatentCache:
    """The layer's :class:`LatentCache`, its widths checked now (``ValueError`` naming the
    layer and what the groups must divide)."""
    dims = f"latent attention: latent width {route.key_dim}, k_pe width {route.value_dim}"
    try:
        if isinstance(latent, LatentCache):
            cache = latent.fresh()
        else:
            cache = LatentCache.from_params(*latent)
        cache.layer = index
        if storage_dtype is not None:
            cache.set_storage_dtype(storage_dtype)
        cache.check_dims(route.key_dim, route.value_dim)
    except ValueError as exc:
        raise ValueError(f"make_cache: layer {index} ({dims}): {exc}") from None
    return cache


def _unserved(route: Route, cache: VeloxCache) -> str:
    """Why ``cache`` cannot serve a layer of this route ("" where it can): a layer with its
    own attention code reads the decoded tokens ``update_and_fetch`` returns, which serves a
    cache without a retention policy."""
    if route.routed:
        return ""
    if route.reason != _OWN_ATTENTION:
        return route.reason
    if cache.policy is not None:
        return (
            f"{route.reason}, and a retention policy needs the queries that only velox's "
            "routed attention shows it"
        )
    return ""


def _dims_text(route: Route) -> str:
    if route.key_dim == route.value_dim:
        return f"head dim {route.key_dim}"
    return f"key head dim {route.key_dim}, value head dim {route.value_dim}"


def _warn_kept(model: Any, kept: dict[str, list[int]]) -> None:
    """Warn once per model and message that layers keep the model's own cache."""
    import warnings

    state = getattr(model, "__velox_routes__", None)
    for reason, idx in kept.items():
        msg = (
            f"make_cache: layer{'s' if len(idx) > 1 else ''} {', '.join(map(str, idx))} keep "
            f"the model's own cache (not compressed): {reason}"
        )
        if state is not None and msg in state.warned:
            continue
        if state is not None:
            state.warned.append(msg)
        warnings.warn(msg, UserWarning, stacklevel=3)


def _link(caches: list) -> None:
    """Let each velox cache class link the layers' caches it shares state across."""
    for cls in dict.fromkeys(type(c) for c in caches if isinstance(c, VeloxCache)):
        cls.link_layers(caches)


def install(
    model: Any,
    default: Any = "uniform",
    layers: dict[int, Any] | None = None,
    storage_dtype: Any = None,
) -> None:
    """Give ``model`` velox caches wherever mlx-lm makes its caches, and route attention.

    Sets ``model.make_cache`` (which mlx-lm's ``make_prompt_cache`` calls: ``generate``,
    ``batch_generate``, ``BatchGenerator`` and the server) to :func:`make_cache` with these
    arguments, checked once now, and turns routing on (:func:`enable`) until
    :func:`uninstall`. Arguments as for :func:`make_cache`. For a host's model
    (:mod:`velox_core.hosts`) it is its language model's ``make_cache`` that is set.
    """
    _, lm = _language_model(model)
    if getattr(lm, "__velox_installed__", False):
        raise ValueError("install: velox caches are already installed on this model")
    make_cache(model, default, layers, storage_dtype)  # refuse a bad spec now

    def velox_caches() -> list:
        return make_cache(model, default, layers, storage_dtype)

    lm.make_cache = velox_caches
    lm.__velox_installed__ = True
    enable(model)


def uninstall(model: Any) -> None:
    """Undo :func:`install`: the model makes its own caches again; one routing level off."""
    _, lm = _language_model(model)
    if not getattr(lm, "__velox_installed__", False):
        return
    del lm.make_cache
    lm.__velox_installed__ = False
    disable()


def _caches(model: Any, cache: Any) -> list:
    if (
        cache is None
        or isinstance(cache, (str, VeloxCache))
        or (callable(cache) and not isinstance(cache, list))
    ):
        return make_cache(model, default=cache if cache is not None else "uniform")
    if isinstance(cache, list):
        return cache
    raise TypeError("cache must be a method spec, a VeloxCache template or a list of caches")


def generate(model: Any, tokenizer: Any, prompt: Any, cache: Any = None, **kwargs: Any) -> str:
    """``mlx_lm.generate`` with velox caches and attention routed to them.

    Args:
        cache: a method spec (``"uniform:bits=4"``), a template cache, or a list from
            :func:`make_cache` (then it is filled in place and can be inspected afterwards;
            with ``draft_model``, the target's caches followed by the draft model's).
        kwargs: passed to ``mlx_lm.generate`` (``max_tokens``, ``sampler``, ``verbose``,
            ``draft_model``...). Speculative decoding trims the caches after each draft, so
            mlx-lm refuses caches whose ``is_trimmable()`` is False (see
            :meth:`VeloxCache.is_trimmable`).
    """
    import mlx_lm

    _refuse_other_host(model, "generate")
    caches = _speculative(_caches(model, cache), cache, kwargs.get("draft_model"))
    with routed(model), routed(kwargs.get("draft_model")):
        return mlx_lm.generate(model, tokenizer, prompt, prompt_cache=caches, **kwargs)


def stream_generate(model: Any, tokenizer: Any, prompt: Any, cache: Any = None, **kwargs: Any):
    """``mlx_lm.stream_generate`` with velox caches; routing is on while it yields."""
    import mlx_lm

    _refuse_other_host(model, "stream_generate")
    caches = _speculative(_caches(model, cache), cache, kwargs.get("draft_model"))
    with routed(model), routed(kwargs.get("draft_model")):
        yield from mlx_lm.stream_generate(model, tokenizer, prompt, prompt_cache=caches, **kwargs)


def _refuse_other_host(model: Any, name: str) -> None:
    host = host_of(model)
    if host is not MLX_LM:
        raise TypeError(
            f"velox_core.{name} runs mlx-lm models; this is a {host.name} model: use "
            f"{host.generate or 'its host package'}"
        )


def _speculative(caches: list, cache: Any, draft_model: Any) -> list:
    """With a draft model (speculative decoding), the target's caches followed by the draft
    model's (mlx-lm splits the list at the target's layer count), made from the same spec;
    a list of caches passed in must then already hold both."""
    if draft_model is None or isinstance(cache, list):
        return caches
    return caches + make_cache(draft_model, default=cache if cache is not None else "uniform")
