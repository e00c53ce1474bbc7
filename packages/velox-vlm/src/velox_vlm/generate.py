"""velox caches in mlx-vlm's generate path: ``make_cache``, ``generate``, ``stream_generate``,
``install`` / ``uninstall``.

mlx-vlm's language models call mlx-vlm's shared ``scaled_dot_product_attention`` with their
caches, as mlx-lm's do with mlx-lm's; velox-core serves them through mlx-vlm's host
(:mod:`velox_vlm.host`): its plain ``KVCache`` layers get velox caches, every other layer
(Gemma 3's sliding windows: ``RotatingKVCache``) keeps mlx-vlm's own cache, and attention of
the velox layers is routed to :meth:`~velox_core.VeloxCache.attend`. Image tokens enter the
language model's caches as embeddings like any others, so they are compressed alike.

mlx-vlm's own KV quantization (``kv_bits``, ``kv_key_bits``, ``kv_value_bits``), speculative
decoding (``draft_model``), ``max_kv_size`` (a rotating cache on every layer) and its automatic
prefix cache (``apc_manager``) are refused up front with velox caches, their settings
(``kv_group_size``, ``quantized_kv_start``, ``draft_kind``...) at any value other than mlx-vlm's
default (:data:`COMPANIONS`), and so is mlx-vlm's
batch path (``BatchGenerator``, ``batch_generate``, its server's continuous batching): velox
caches serve one sequence at a time here.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from typing import Any

import velox_core
from velox_core import LatentCache, VeloxCache

from .host import language_model

__all__ = [
    "COMPANIONS",
    "REFUSED",
    "check_options",
    "generate",
    "install",
    "make_cache",
    "stream_generate",
]
__all__ += ["uninstall"]

# generate options of mlx-vlm 0.7 that turn on what velox caches cannot serve, with why:
# refused whenever given (not None)
_KV_QUANT = "mlx-vlm's own KV-cache quantization, which would replace or skip velox's caches"
_DRAFT = "speculative decoding, whose draft rounds trim and rebuild the caches"
REFUSED: dict[str, str] = {
    "kv_bits": _KV_QUANT,
    "kv_key_bits": _KV_QUANT,
    "kv_value_bits": _KV_QUANT,
    "draft_model": _DRAFT,
    "max_kv_size": "a rotating fp16 cache on every layer (velox caches replace it)",
    "apc_manager": "mlx-vlm's automatic prefix cache, which stores mlx-vlm's own cache blocks",
}
# settings of those features, which mlx-vlm ignores without them: accepted at mlx-vlm's own
# default values (its command line and server pass them on every call; generate_step's and
# BatchGenerator's defaults) and refused at any other value, which asks for a quantization
# or a draft model that velox caches replace
COMPANIONS: dict[str, tuple[tuple[Any, ...], str]] = {
    "kv_group_size": ((64,), "kv_bits"),
    "kv_quant_scheme": (("uniform",), "kv_bits"),
    "quantized_kv_start": ((5000, 0), "kv_bits"),
    "kv_key_scheme": ((), "kv_bits"),
    "kv_value_scheme": ((), "kv_bits"),
    "draft_kind": (("dflash",), "draft_model"),
    "draft_block_size": ((), "draft_model"),
}

_BATCH = (
    "velox caches serve mlx-vlm's single-sequence generate and stream_generate only; mlx-vlm's "
    "batch path (BatchGenerator, batch_generate, the server's continuous batching) is not "
    "supported: generate one sequence at a time, or velox_vlm.uninstall(model) first"
)


def check_options(kwargs: dict[str, Any], where: str = "velox_vlm.generate") -> None:
    """Refuse mlx-vlm generate options that velox caches cannot honour: a ``ValueError``
    naming each option and why. The options of :data:`REFUSED` are refused whenever given
    (not None); their settings (:data:`COMPANIONS`: ``kv_group_size``, ``kv_quant_scheme``,
    ``quantized_kv_start``, ``draft_kind``...) only at a value other than mlx-vlm's default
    (its defaults do nothing without ``kv_bits`` or ``draft_model``). ``input_ids`` of more
    than one sequence are refused too."""
    why = [f"{k}: {REFUSED[k]}" for k in REFUSED if kwargs.get(k) is not None]
    for k, (defaults, switch) in COMPANIONS.items():
        v = kwargs.get(k)
        if v is not None and v not in defaults:
            allowed = " or ".join(repr(d) for d in (None, *defaults))
            why.append(f"{k}={v!r}: a setting of {switch} ({REFUSED[switch]}); allowed: {allowed}")
    if why:
        names = ", ".join(w.split(":")[0] for w in why)
        raise ValueError(
            f"{where}: velox caches cannot be combined with {names} ({'; '.join(why)}). "
            "Choose the compression with the velox spec instead (e.g. 'uniform:bits=4')."
        )
    ids = kwargs.get("input_ids")
    if ids is not None and getattr(ids, "ndim", 0) == 2 and ids.shape[0] > 1:
        raise ValueError(f"{where}: input_ids hold {ids.shape[0]} sequences; {_BATCH}")


def make_cache(
    model: Any,
    default: Any = "uniform",
    layers: dict[int, Any] | None = None,
    storage_dtype: Any = None,
) -> list:
    """Fresh per-layer caches for an mlx-vlm model's language model.

    Arguments as :func:`velox_core.make_cache` (``default``: a method spec such as
    ``"uniform:bits=4"``, a template cache, a callable, or ``"fp16"``); layers whose mlx-vlm
    cache is not a plain ``KVCache`` keep it. Pass the list as ``cache=`` to
    :func:`generate` / :func:`stream_generate`, or save it with ``velox_core.save_cache``.
    """
    _require_vlm(model, "make_cache")
    return velox_core.make_cache(model, default, layers, storage_dtype)


def _require_vlm(model: Any, name: str) -> None:
    if not type(model).__module__.startswith("mlx_vlm."):
        raise TypeError(
            f"velox_vlm.{name} takes an mlx-vlm model (mlx_vlm.load), got "
            f"{type(model).__module__}.{type(model).__name__}; mlx-lm models: velox_core.{name}"
        )


def _caches(model: Any, cache: Any) -> list:
    if isinstance(cache, list):
        if not any(isinstance(c, (VeloxCache, LatentCache)) for c in cache):
            raise ValueError(
                "cache: the list holds no velox cache; make it with velox_vlm.make_cache(model, "
                "spec), or call mlx_vlm.generate for mlx-vlm's own caches"
            )
        n = len(language_model(model).layers)
        if len(cache) != n:
            raise ValueError(f"cache: {len(cache)} caches for a language model of {n} layers")
        return cache
    if isinstance(cache, (str, VeloxCache)) or callable(cache):
        return make_cache(model, cache)
    raise TypeError(
        "cache must be a method spec ('uniform:bits=4'), a VeloxCache template, a callable "
        f"layer_index -> cache or a list from velox_vlm.make_cache; got {type(cache).__name__}"
    )


def _check_state(kwargs: dict[str, Any]) -> None:
    """A ``prompt_cache_state`` (multi-turn reuse) must hold velox caches or nothing yet."""
    state = kwargs.get("prompt_cache_state")
    held = getattr(state, "cache", None)
    if held is not None and not any(isinstance(c, (VeloxCache, LatentCache)) for c in held):
        raise ValueError(
            "prompt_cache_state holds mlx-vlm's own caches from an earlier turn; start the "
            "conversation with velox caches (a fresh mlx_vlm.generate.PromptCacheState())"
        )


def _prepare(model: Any, cache: Any, kwargs: dict[str, Any], name: str) -> list:
    """The checks of ``velox_vlm.<name>`` before anything runs, and the caches it fills."""
    _require_vlm(model, name)
    check_options(kwargs, f"velox_vlm.{name}")
    if "prompt_cache" in kwargs:
        raise ValueError("pass velox caches as cache=, not prompt_cache=")
    _check_state(kwargs)
    return _caches(model, cache)


def stream_generate(
    model: Any,
    processor: Any,
    prompt: Any,
    image: Any = None,
    *,
    cache: Any = "uniform",
    **kwargs: Any,
) -> Iterator[Any]:
    """``mlx_vlm.stream_generate`` with velox caches, attention routed to them while it yields.

    Args:
        model, processor, prompt, image: as for ``mlx_vlm.stream_generate``.
        cache: a method spec, a template cache, or a list from :func:`make_cache` (filled in
            place). With ``prompt_cache_state`` (mlx-vlm's multi-turn reuse) a turn that
            continues the previous one's tokens reuses its compressed caches (mlx-vlm trims
            them back to the shared prefix only where ``is_trimmable()`` holds, else it
            prefills afresh with ``cache``).
        kwargs: passed on (``max_tokens``, ``temperature``, ``prefill_step_size``,
            ``prompt_cache_state``, ``input_ids`` and ``pixel_values`` prepared by hand...);
            the options of :data:`REFUSED` raise ``ValueError`` before anything runs.
    """
    import mlx_vlm

    caches = _prepare(model, cache, kwargs, "stream_generate")
    with velox_core.routed(model):
        yield from _unwrap(mlx_vlm.stream_generate)(
            model, processor, prompt, image, prompt_cache=caches, **kwargs
        )


def generate(
    model: Any,
    processor: Any,
    prompt: Any,
    image: Any = None,
    *,
    cache: Any = "uniform",
    verbose: bool = False,
    **kwargs: Any,
) -> Any:
    """``mlx_vlm.generate`` with velox caches (arguments as :func:`stream_generate`); returns
    mlx-vlm's ``GenerationResult``."""
    import mlx_vlm

    caches = _prepare(model, cache, kwargs, "generate")
    with velox_core.routed(model):
        return mlx_vlm.generate(
            model, processor, prompt, image, verbose=verbose, prompt_cache=caches, **kwargs
        )


# -- install: velox caches wherever mlx-vlm's generate makes its caches --------------------

_guards: dict[tuple[str, str], Callable] = {}  # (module, name) -> the original there
_installed = 0  # models installed now


def _unwrap(fn: Callable) -> Callable:
    return getattr(fn, "__velox_original__", fn)


def _uses_velox(model: Any, caches: Any) -> bool:
    if isinstance(caches, list):
        return any(isinstance(c, (VeloxCache, LatentCache)) for c in caches)
    return bool(getattr(language_model(model), "__velox_installed__", False))


def _guard_stream(original: Callable) -> Callable:
    def stream_generate(model, processor, prompt, *args, **kwargs):
        # a generator: the checks run at the first next(), before mlx-vlm does anything
        state = kwargs.get("prompt_cache_state")
        held = getattr(state, "cache", None)
        if _uses_velox(model, kwargs.get("prompt_cache", held)):
            check_options(kwargs, "mlx_vlm.stream_generate with velox caches")
        yield from original(model, processor, prompt, *args, **kwargs)

    stream_generate.__velox_original__ = original
    return stream_generate


def _guard_step(original: Callable) -> Callable:
    def generate_step(input_ids, model, *args, **kwargs):
        if _uses_velox(model, kwargs.get("prompt_cache")):
            check_options(kwargs, "mlx_vlm.generate_step with velox caches")
        return original(input_ids, model, *args, **kwargs)

    generate_step.__velox_original__ = original
    return generate_step


def _guard_batch(original: Callable) -> Callable:
    """``BatchGenerator.__new__`` refusing an installed model before any object exists (a
    refusal in ``__init__`` would leave a half-built generator to mlx-vlm's ``__del__``)."""

    def __new__(cls, model=None, *args, **kwargs):
        if model is not None and getattr(language_model(model), "__velox_installed__", False):
            raise ValueError(f"mlx_vlm BatchGenerator: {_BATCH}")
        return (
            original(cls) if original is object.__new__ else original(cls, model, *args, **kwargs)
        )

    __new__.__velox_original__ = original
    return __new__


def _patch() -> None:
    """Point mlx-vlm's ``stream_generate`` and ``generate_step`` (in every loaded mlx-vlm
    module that holds them) and ``BatchGenerator.__new__`` at guards that refuse what velox
    caches cannot serve (:func:`check_options`, the batch path)."""
    from mlx_vlm.generate import ar, dispatch

    wrappers = {
        "stream_generate": (_unwrap(dispatch.stream_generate), _guard_stream),
        "generate_step": (_unwrap(ar.generate_step), _guard_step),
    }
    for name, (original, make) in wrappers.items():
        guard = make(original)
        for mod_name in [
            m for m in list(sys.modules) if m == "mlx_vlm" or m.startswith("mlx_vlm.")
        ]:
            mod = sys.modules.get(mod_name)
            if mod is not None and getattr(mod, name, None) is original:
                _guards[(mod_name, name)] = original
                setattr(mod, name, guard)
    cls = ar.BatchGenerator
    if not hasattr(cls.__new__, "__velox_original__"):
        # set once and kept: Python cannot give a class back an inherited __new__ once one
        # was set (object.__new__ then refuses the constructor's arguments); with no model
        # installed the guard passes every call through
        cls.__new__ = staticmethod(_guard_batch(cls.__new__))


def _unpatch() -> None:

    for (mod_name, name), original in _guards.items():
        mod = sys.modules.get(mod_name)
        if mod is not None:
            setattr(mod, name, original)
    _guards.clear()


def install(
    model: Any,
    default: Any = "uniform",
    layers: dict[int, Any] | None = None,
    storage_dtype: Any = None,
) -> None:
    """Give an mlx-vlm model velox caches wherever mlx-vlm's single-sequence generate makes
    its caches (``mlx_vlm.generate``, ``stream_generate``, ``generate_step``, multi-turn
    ``prompt_cache_state``), and route attention, until :func:`uninstall`.

    :func:`velox_core.install` through mlx-vlm's host (the language model's ``make_cache``
    is set); while any model is installed, mlx-vlm's ``stream_generate`` and
    ``generate_step`` refuse the options of :data:`REFUSED` with velox caches before anything
    runs, and ``BatchGenerator`` (``batch_generate``, the server) refuses an installed model.
    Arguments as for :func:`make_cache`.
    """
    global _installed
    _require_vlm(model, "install")
    velox_core.install(model, default, layers, storage_dtype)
    if _installed == 0:
        _patch()
    _installed += 1


def uninstall(model: Any) -> None:
    """Undo :func:`install` (the last one also restores mlx-vlm's ``stream_generate`` and
    ``generate_step``; ``BatchGenerator``'s guard stays, passing every model through)."""
    global _installed
    if not getattr(language_model(model), "__velox_installed__", False):
        return
    velox_core.uninstall(model)
    _installed -= 1
    if _installed == 0:
        _unpatch()
