"""Methods registered through the entry-point group ``velox.methods``, and method specs.

A method package declares, in its ``pyproject.toml``::

    [project.entry-points."velox.methods"]
    kivi = "velox_kivi:METHOD"

where ``METHOD`` is a :class:`Method`. Plugins are loaded lazily, on first use; one that fails
to import is skipped with a warning. A *spec* names a method and its parameters as text:
``"uniform"`` or ``"uniform:bits=4,group=64"``.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from importlib.metadata import entry_points
from typing import Any

from .codec.base import Codec
from .codec.identity import Identity
from .codec.uniform import Uniform
from .hosts import load_plugins
from .policy.base import RetentionPolicy

__all__ = ["method_params"]

GROUP = "velox.methods"


@dataclass(frozen=True)
class Method:
    """What a method package registers.

    Attributes:
        name: the method's name in specs, files and tables.
        cache_class: its :class:`~velox_core.cache.VeloxCache` preset, built from keyword
            parameters (the shared names: bits, key_bits, value_bits, group, window, sinks,
            budget, seed, plus its own).
        summary: one line for ``velox methods``.
        paper: the arXiv link, if any.
        codecs: codec classes it brings (so saved caches using them can be loaded).
        policies: retention policy classes it brings.
        recommended: parameter sets ``velox bench`` runs by default.
    """

    name: str
    cache_class: type
    summary: str
    paper: str | None = None
    codecs: tuple[type[Codec], ...] = ()
    policies: tuple[type[RetentionPolicy], ...] = ()
    recommended: tuple[dict[str, Any], ...] = field(default_factory=lambda: ({},))

    @classmethod
    def of(cls, cache_class: type, summary: str, **rest: Any) -> Method:
        """The registration of ``cache_class`` under the name it carries (its ``method``, the
        name its errors, descriptions and saved files use), so the name is stated once;
        ``rest``: the other attributes (``paper``, ``codecs``, ``policies``, ``recommended``).
        """
        return cls(name=cache_class.method, cache_class=cache_class, summary=summary, **rest)


_methods: dict[str, Method] | None = None
_BUILTIN_CODECS: dict[str, type[Codec]] = {Identity.name: Identity, Uniform.name: Uniform}
_EXTRA: dict[str, dict[str, type]] = {"codec": {}, "policy": {}}


def register(cls: type) -> type:
    """Make a codec or retention policy class loadable in this process (for saved caches that
    use a class defined outside a method package). Usable as a decorator."""
    if isinstance(cls, type) and issubclass(cls, Codec):
        _EXTRA["codec"][cls.name] = cls
    elif isinstance(cls, type) and issubclass(cls, RetentionPolicy):
        _EXTRA["policy"][cls.name] = cls
    else:
        raise TypeError(f"register: expected a Codec or RetentionPolicy subclass, got {cls!r}")
    return cls


def reset() -> None:
    """Forget loaded plugins (the next lookup reads the entry points again)."""
    global _methods
    _methods = None


def methods() -> dict[str, Method]:
    """Installed methods by name (plugins load on the first call)."""
    global _methods
    if _methods is None:
        found = {m.name: m for m in load_plugins(entry_points(group=GROUP), Method)}
        _methods = dict(sorted(found.items()))
    return _methods


def get_method(name: str) -> Method:
    ms = methods()
    if name not in ms:
        have = ", ".join(ms) or "none"
        raise ValueError(f"unknown method {name!r}; installed methods: {have}")
    return ms[name]


def _codec_classes() -> dict[str, type[Codec]]:
    out = dict(_BUILTIN_CODECS)
    for m in methods().values():
        out.update({c.name: c for c in m.codecs})
    out.update(_EXTRA["codec"])
    return out


def build_codec(spec: dict[str, Any]) -> Codec:
    """A codec from ``{"name": ..., "config": {...}}`` (registered codecs only)."""
    classes = _codec_classes()
    name = spec.get("name") if isinstance(spec, dict) else None
    if name not in classes:
        raise ValueError(f"unknown codec {name!r}; registered codecs: {', '.join(classes)}")
    return classes[name].from_config(dict(spec.get("config", {})))


def build_policy(spec: dict[str, Any]) -> RetentionPolicy:
    """A retention policy from ``{"name": ..., "config": {...}}`` (registered policies only)."""
    classes = {RetentionPolicy.name: RetentionPolicy}
    classes.update({p.name: p for m in methods().values() for p in m.policies})
    classes.update(_EXTRA["policy"])
    name = spec.get("name") if isinstance(spec, dict) else None
    if name not in classes:
        raise ValueError(
            f"unknown policy {name!r}; registered policies: {', '.join(classes) or 'none'}"
        )
    return classes[name].from_config(dict(spec.get("config", {})))


def method_params(name: str) -> dict[str, Any]:
    """The keyword parameters of a method's cache class with their defaults."""
    cls = get_method(name).cache_class
    if hasattr(cls, "defaults"):
        return cls.defaults()
    out = {}
    for p in inspect.signature(cls.__init__).parameters.values():
        if p.name == "self" or p.kind in (p.VAR_KEYWORD, p.VAR_POSITIONAL):
            continue
        out[p.name] = None if p.default is inspect.Parameter.empty else p.default
    return out


def _value(text: str) -> Any:
    low = text.lower()
    if low in ("true", "false"):
        return low == "true"
    if low in ("none", "null"):
        return None
    for conv in (int, float):
        try:
            return conv(text)
        except ValueError:
            pass
    return text


def parse_spec(spec: str) -> tuple[str, dict[str, Any]]:
    """``"name:key=value,key=value"`` to ``(name, params)``; values become int/float/bool/None."""
    if not isinstance(spec, str) or not spec.strip():
        raise ValueError(f"a method spec must be a non-empty string, got {spec!r}")
    name, _, rest = spec.strip().partition(":")
    params: dict[str, Any] = {}
    for item in filter(None, (s.strip() for s in rest.split(","))):
        key, eq, val = item.partition("=")
        if not eq or not key.strip():
            raise ValueError(f"bad parameter {item!r} in spec {spec!r}: expected key=value")
        if key.strip() in params:
            raise ValueError(f"parameter {key.strip()!r} is given twice in spec {spec!r}")
        params[key.strip()] = _value(val.strip())
    return name.strip(), params


def make(spec: str, **params: Any):
    """A fresh cache from a spec string, e.g. ``make("uniform:bits=4")``.

    Unknown parameters raise ``ValueError`` listing the ones the method accepts.
    """
    if isinstance(spec, str) and "+" in spec:
        head = spec.split("+", 1)[1].split(":", 1)[0].strip()
        if head in methods() or head in ("fp16", "mlx-q4", "mlx-q8"):
            raise ValueError(
                f"{spec!r} composes two specs (A+B: A's policy, B's codecs), which velox bench "
                "and velox generate take; make_cache and velox serve take one method's spec "
                "(compose in Python: VeloxCache(key_codec=..., value_codec=..., policy=...))"
            )
    name, parsed = parse_spec(spec)
    parsed.update(params)
    allowed = method_params(name)
    unknown = sorted(set(parsed) - set(allowed))
    if unknown:
        raise ValueError(
            f"method {name!r} has no parameter {', '.join(map(repr, unknown))}; "
            f"allowed: {', '.join(allowed)}"
        )
    return get_method(name).cache_class(**parsed)
