"""Integration with mlx-lm: per-layer caches, attention routing, and ``generate``.

mlx-lm models call the shared ``scaled_dot_product_attention`` of ``mlx_lm.models.base``,
imported by name into each model module. :func:`enable` points that name, in every loaded
``mlx_lm.models`` module that uses it, at a router that sends layers whose cache is a
:class:`VeloxCache` to :meth:`VeloxCache.attend` (attention from the codes) and every other
layer to the original function. :func:`disable` restores the originals; :func:`routed` is the
context manager. Nothing is patched on import. Without routing a velox cache still gives
correct results: ``update_and_fetch`` returns the decoded keys and values, which the model's
own attention then uses (slower, and transiently fp16).
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from . import routing
from .cache.batch import VeloxBatch
from .cache.velox import VeloxCache
from .registry import make

__all__ = [
    "ROUTED_ONLY_MODEL_TYPES",
    "disable",
    "enable",
    "generate",
    "install",
    "is_enabled",
    "make_cache",
    "routed",
    "stream_generate",
    "uninstall",
]

_patched: dict[str, Callable] = {}


def _original() -> Callable:
    import mlx_lm.models.base as base

    fn = base.scaled_dot_product_attention
    return getattr(fn, "__velox_original__", fn)


def _make_router(original: Callable) -> Callable:
    def scaled_dot_product_attention(queries, keys, values, cache, scale, mask, sinks=None, **kw):
        if isinstance(cache, (VeloxCache, VeloxBatch)):
            return cache.attend(queries, scale=scale, mask=mask, sinks=sinks)
        return original(
            queries, keys, values, cache=cache, scale=scale, mask=mask, sinks=sinks, **kw
        )

    scaled_dot_product_attention.__velox_original__ = original
    return scaled_dot_product_attention


def _patch_all(extra_modules: list[str]) -> None:
    original = _original()
    router = _make_router(original)
    names = [
        n for n in list(sys.modules) if n == "mlx_lm.models.base" or n.startswith("mlx_lm.models.")
    ]
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

    Patches every loaded ``mlx_lm.models`` module (and the modules of ``model``'s layers)
    that uses the shared attention function. Calls nest: routing stays on until the matching
    number of :func:`disable` calls.
    """
    routing.enter()
    extra = []
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


def is_enabled() -> bool:
    """Whether attention is routed now (:mod:`velox_core.routing`)."""
    return routing.is_enabled()


@contextmanager
def routed(model: Any = None) -> Iterator[None]:
    """``with routed(model): ...`` enables routing for the block."""
    enable(model)
    try:
        yield
    finally:
        disable()


# mlx-lm model types (0.32; mistral runs the llama module) whose attention layers pass what
# update_and_fetch returns only to the shared scaled_dot_product_attention (with their cache)
# and share no keys across layers: under routing their velox caches need not build every
# stored token decoded each step
ROUTED_ONLY_MODEL_TYPES = frozenset({"llama", "mistral", "qwen2", "qwen3", "phi3", "gemma3_text"})


def _model_type(model: Any) -> str | None:
    t = getattr(model, "model_type", None)
    if t is None:
        t = getattr(getattr(model, "args", None), "model_type", None)
    return t if isinstance(t, str) else None


def _layer_count(model: Any) -> int:
    layers = getattr(model, "layers", None)
    if layers is None:
        raise ValueError("make_cache: the model has no .layers; is it an mlx-lm model?")
    return len(layers)


def _head_dim(model: Any, index: int) -> int | None:
    """The head dim of layer ``index``'s attention, where the model states it (mlx-lm's
    attention modules keep ``head_dim``; else its args' ``head_dim`` or hidden size per
    head), or None."""
    attn = getattr(model.layers[index], "self_attn", None)
    dim = getattr(attn, "head_dim", None)
    if isinstance(dim, int) and dim > 0:
        return dim
    args = getattr(model, "args", None)
    dim = getattr(args, "head_dim", None)
    if isinstance(dim, int) and dim > 0:
        return dim
    hidden, heads = getattr(args, "hidden_size", None), getattr(args, "num_attention_heads", None)
    if isinstance(hidden, int) and isinstance(heads, int) and heads > 0 and hidden % heads == 0:
        return hidden // heads
    return None


def _build(spec: Any, index: int) -> Any:
    from mlx_lm.models.cache import KVCache

    if spec is None or spec == "fp16":
        return KVCache()
    if isinstance(spec, VeloxCache):
        return spec.fresh()
    if isinstance(spec, str):
        return make(spec)
    if callable(spec):
        out = spec(index)
        if out is None:
            return KVCache()
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
    linear attention / SSM state) keep the model's own cache.

    Args:
        model: an mlx-lm model.
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
    from mlx_lm.models.cache import KVCache

    n = _layer_count(model)
    native = _native_caches(model)
    if len(native) != n:
        raise ValueError(f"make_cache: the model made {len(native)} caches for {n} layers")
    overrides: dict[int, Any] = {}
    for k, spec in (layers or {}).items():
        if isinstance(k, bool) or not isinstance(k, int) or not -n <= k < n:
            raise ValueError(f"make_cache: layer index {k!r} out of range for {n} layers")
        overrides[k % n] = spec
    out = []
    routed_only = _model_type(model) in ROUTED_ONLY_MODEL_TYPES
    for i, c in enumerate(native):
        if type(c) is not KVCache:
            out.append(c)
            continue
        cache = _build(overrides.get(i, default), i)
        if isinstance(cache, VeloxCache):
            cache.bind(model, i)
            dim = _head_dim(model, i)
            if dim is not None:  # refuse a head dim the method cannot code now, not mid-forward
                try:
                    cache.check_dims(dim, dim, storage_dtype)
                except ValueError as exc:
                    raise ValueError(
                        f"make_cache: layer {i} (head dim {dim}), {cache.describe()}: {exc}"
                    ) from None
            if routed_only:
                cache.fetch_decoded = False
            if storage_dtype is not None:
                cache.set_storage_dtype(storage_dtype)
        out.append(cache)
    _link(out)
    return out


def _link(caches: list) -> None:
    """Let each velox cache class link the layers' caches it shares state across."""
    for cls in dict.fromkeys(type(c) for c in caches if isinstance(c, VeloxCache)):
        cls.link_layers(caches)


def _native_caches(model: Any) -> list:
    """The caches the model's own class makes (mlx-lm's ``make_prompt_cache`` without the
    override set by :func:`install`): its ``make_cache`` where the class has one, else a
    ``KVCache`` per layer."""
    from mlx_lm.models.cache import KVCache

    own = getattr(type(model), "make_cache", None)
    if own is not None:
        return own(model)
    return [KVCache() for _ in range(_layer_count(model))]


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
    :func:`uninstall`. Arguments as for :func:`make_cache`.
    """
    if getattr(model, "__velox_installed__", False):
        raise ValueError("install: velox caches are already installed on this model")
    make_cache(model, default, layers, storage_dtype)  # refuse a bad spec now

    def velox_caches() -> list:
        return make_cache(model, default, layers, storage_dtype)

    model.make_cache = velox_caches
    model.__velox_installed__ = True
    enable(model)


def uninstall(model: Any) -> None:
    """Undo :func:`install`: the model makes its own caches again; one routing level off."""
    if not getattr(model, "__velox_installed__", False):
        return
    del model.make_cache
    model.__velox_installed__ = False
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

    caches = _speculative(_caches(model, cache), cache, kwargs.get("draft_model"))
    with routed(model), routed(kwargs.get("draft_model")):
        return mlx_lm.generate(model, tokenizer, prompt, prompt_cache=caches, **kwargs)


def stream_generate(model: Any, tokenizer: Any, prompt: Any, cache: Any = None, **kwargs: Any):
    """``mlx_lm.stream_generate`` with velox caches; routing is on while it yields."""
    import mlx_lm

    caches = _speculative(_caches(model, cache), cache, kwargs.get("draft_model"))
    with routed(model), routed(kwargs.get("draft_model")):
        yield from mlx_lm.stream_generate(model, tokenizer, prompt, prompt_cache=caches, **kwargs)


def _speculative(caches: list, cache: Any, draft_model: Any) -> list:
    """With a draft model (speculative decoding), the target's caches followed by the draft
    model's (mlx-lm splits the list at the target's layer count), made from the same spec;
    a list of caches passed in must then already hold both."""
    if draft_model is None or isinstance(cache, list):
        return caches
    return caches + make_cache(draft_model, default=cache if cache is not None else "uniform")
