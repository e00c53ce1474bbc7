"""Hosts: the libraries whose models velox makes caches for.

mlx-lm is built in (:data:`MLX_LM`). Another library whose models call a shared attention
function with their caches, as mlx-lm's do (mlx-vlm's language models, say), registers a
:class:`Host` through the entry-point group ``velox.hosts``::

    [project.entry-points."velox.hosts"]
    mlx_vlm = "velox_vlm.host:host"

(a :class:`Host`, or a function of no arguments returning one), or in the process with
:func:`add_host`. Entry points are read on first need (a model no registered host owns, or a
host name no registered host has); one that fails to load is skipped with a warning. A host
module should import its library lazily: every field that needs it is a function.

``make_cache``, ``install``, ``layer_routes`` and routing (:mod:`velox_core.mlx_lm`) ask
:func:`host_of` which host a model belongs to and work on that host's language model;
``save_cache`` / ``load_cache`` store the host's own caches of the layers velox leaves alone
(a sliding window's, say) through :attr:`Host.saved_classes`.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from importlib.metadata import entry_points
from typing import Any

# a host's author needs these two; host_of, get_host, hosts and MLX_LM serve velox-core's own
# modules (importable, not part of its face: tools/public_names.py)
__all__ = ["Host", "add_host"]

GROUP = "velox.hosts"


def _same(model: Any) -> Any:
    return model


@dataclass(frozen=True)
class Host:
    """How velox-core works with one library's models.

    Attributes:
        name: the host's name (in saved files and messages).
        owns: whether a model (or a language model) belongs to this host; cheap, and without
            importing the library (a model's class module is enough).
        attention: ``(module, prefix)``: the module defining the library's shared
            ``scaled_dot_product_attention`` (called as ``(queries, keys, values, cache,
            scale, mask, sinks=None)``) and the prefix of the model modules that import it by
            name; routing points those names at velox's router while it is on.
        plain_cache: a fresh plain KV cache of the library (what a layer of a language model
            without ``make_cache`` gets).
        is_plain: whether a cache is the library's plain KV cache: the layers velox replaces
            (any other cache, a sliding window's or a state-space layer's, is kept).
        language_model: the module whose ``layers`` the caches are for and whose
            ``make_cache`` the library calls (the model itself for mlx-lm; mlx-vlm's
            ``model.language_model``).
        probe: runs the language model once on ``tokens`` with ``caches`` (``layer_routes``
            does, twice: two tokens, then one), leaving the model as it found it; None: a call
            ``language_model(tokens, cache=caches)``.
        routed_only: model types of this library whose layers read their keys only through
            the shared attention function (see ``velox_core.mlx_lm.ROUTED_ONLY_MODEL_TYPES``).
        saved_classes: the library's cache classes ``save_cache`` may store for the layers
            velox leaves alone, by class name (a function returning them: it may import the
            library); each is rebuilt with ``cls.from_state(state, meta_state)`` (mlx-vlm's
            caches), or ``cls.from_state(state)`` for a class without ``meta_state`` (mlx-lm's).
        generate: the function that generates with this host's models (for messages).
    """

    name: str
    owns: Callable[[Any], bool]
    attention: tuple[str, str]
    plain_cache: Callable[[], Any]
    is_plain: Callable[[Any], bool]
    language_model: Callable[[Any], Any] = _same
    probe: Callable[[Any, Any, list], None] | None = None
    routed_only: frozenset[str] = field(default_factory=frozenset)
    saved_classes: Callable[[], dict[str, type]] | None = None
    generate: str = ""

    def run_probe(self, lm: Any, tokens: Any, caches: list) -> None:
        """Run ``lm`` once on ``tokens`` with ``caches`` (:attr:`probe`)."""
        if self.probe is not None:
            self.probe(lm, tokens, caches)
        else:
            lm(tokens, cache=caches)


def _mlx_lm_plain() -> Any:
    from mlx_lm.models.cache import KVCache

    return KVCache()


def _mlx_lm_is_plain(cache: Any) -> bool:
    from mlx_lm.models.cache import KVCache

    return type(cache) is KVCache


# mlx-lm model types (0.32; mistral runs the llama module) whose attention layers pass what
# update_and_fetch returns only to the shared scaled_dot_product_attention (with their cache)
# and share no keys across layers
_MLX_LM_ROUTED_ONLY = frozenset({"llama", "mistral", "qwen2", "qwen3", "phi3", "gemma3_text"})

MLX_LM = Host(
    name="mlx_lm",
    owns=lambda model: type(model).__module__.startswith("mlx_lm."),
    attention=("mlx_lm.models.base", "mlx_lm.models."),
    plain_cache=_mlx_lm_plain,
    is_plain=_mlx_lm_is_plain,
    routed_only=_MLX_LM_ROUTED_ONLY,
    generate="velox_core.generate",
)

_hosts: dict[str, Host] = {MLX_LM.name: MLX_LM}
_loaded = False  # entry points read


def add_host(host: Host) -> Host:
    """Register ``host`` in this process (replacing one of the same name, except mlx-lm's)."""
    if not isinstance(host, Host):
        raise TypeError(f"add_host: expected a velox_core Host, got {type(host).__name__}")
    if host.name == MLX_LM.name and host is not MLX_LM:
        raise ValueError(f"add_host: the name {MLX_LM.name!r} is velox-core's own host")
    _hosts[host.name] = host
    return host


def load_plugins(eps: Iterable[Any], cls: type, call: bool = False) -> list[Any]:
    """The ``cls`` instances that the entry points ``eps`` give, in order (``call``: one may
    also give a function of no arguments returning one). One that fails to load, or gives
    something else, is skipped with a ``RuntimeWarning``: a broken plugin must not break the
    others. (The methods' entry points are read with it too.)"""
    found = []
    for ep in eps:
        try:
            obj = ep.load()
            if call and not isinstance(obj, cls):
                obj = obj()
            if not isinstance(obj, cls):
                raise TypeError(f"it gives a {type(obj).__name__}, not a velox_core {cls.__name__}")
        except Exception as e:
            warnings.warn(
                f"velox: skipping {cls.__name__.lower()} plugin {ep.name!r} ({ep.value}): {e}",
                RuntimeWarning,
                stacklevel=3,
            )
            continue
        found.append(obj)
    return found


def _load_entry_points() -> None:
    global _loaded
    if _loaded:
        return
    _loaded = True
    for host in load_plugins(entry_points(group=GROUP), Host, call=True):
        _hosts.setdefault(host.name, host)


def hosts(load: bool = True) -> dict[str, Host]:
    """The registered hosts by name (``load``: the entry points read first)."""
    if load:
        _load_entry_points()
    return dict(_hosts)


def get_host(name: str) -> Host:
    """The host called ``name`` (``ValueError`` naming the installed ones otherwise)."""
    if name not in _hosts:
        _load_entry_points()
    if name not in _hosts:
        raise ValueError(
            f"unknown host {name!r} (install the velox package for it); installed hosts: "
            f"{', '.join(sorted(_hosts))}"
        )
    return _hosts[name]


def host_of(model: Any) -> Host:
    """The host ``model`` belongs to: a registered host that owns it, else mlx-lm's (every
    model with ``layers`` that no other host owns is treated as an mlx-lm model)."""
    if MLX_LM.owns(model):
        return MLX_LM
    for _ in range(2):
        for host in _hosts.values():
            if host is not MLX_LM and host.owns(model):
                return host
        if _loaded:
            break
        _load_entry_points()
    return MLX_LM
