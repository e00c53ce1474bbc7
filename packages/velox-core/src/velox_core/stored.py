"""A model's caches read as the tokens they hold, and caches of the same classes made again
around other tokens: what the storage formats that re-code a cache's tokens share
(velox-kvtc, velox-cachegen).

:meth:`StoredTokens.read` takes one cache per layer (mlx-lm ``KVCache``, or a velox cache that
keeps every token at its position: its decoded tokens) and keeps each layer's keys and values
(post-RoPE, positions ``0 .. T-1``) with a record of what rebuilds it: its class, and a velox
cache's method, settings and dtypes. Those records are JSON, written into a format's header;
:meth:`StoredTokens.check_records` checks them when a file is read back, before anything is
decoded, and :meth:`StoredTokens.build` makes caches of the recorded classes around decoded
tokens: an mlx-lm ``KVCache`` gets them as they are, a velox cache is made again from its
settings and encodes them as a prefill would. Either continues decoding. :func:`read_file`
reads a format's file, its errors naming the file; :func:`header_int` and
:func:`header_user` check the header fields the formats share.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import mlx.core as mx
from mlx_lm.models.cache import KVCache

from .cache.velox import VeloxCache
from .mlx_lm import make_cache
from .registry import get_method
from .validation import is_str_map

__all__ = ["StoredTokens"]

_DTYPES = {"float16": mx.float16, "bfloat16": mx.bfloat16, "float32": mx.float32}
T = TypeVar("T")


def read_file(path: str | os.PathLike, parse: Callable[[bytes], T]) -> T:
    """``parse`` of the bytes of the file at ``path``; a ``ValueError`` it raises is raised
    again with the path in front (``"<path>: no such file"`` where there is no file)."""
    p = Path(path)
    if not p.is_file():
        raise ValueError(f"{path}: no such file")
    data = p.read_bytes()
    try:
        return parse(data)
    except ValueError as e:
        raise ValueError(f"{path}: {e}") from None


def header_int(h: dict, name: str, minimum: int) -> int:
    """The header field ``name``, which must be an int >= ``minimum`` (``ValueError``,
    "corrupt header", otherwise)."""
    v = h[name]
    if isinstance(v, bool) or not isinstance(v, int) or v < minimum:
        raise ValueError(f"corrupt header: {name} must be an int >= {minimum}, got {v!r}")
    return v


def header_user(h: dict) -> dict[str, str]:
    """The header's ``user`` field, the caller's metadata: a dict of str to str."""
    if not is_str_map(h["user"]):
        raise ValueError("corrupt header: user metadata must map str to str")
    return dict(h["user"])


def _name(dt: mx.Dtype) -> str:
    return str(dt).split(".")[-1]


def _describe(i: int, c: Any, who: str) -> dict[str, Any]:
    if type(c) is KVCache:
        if c.keys is None:
            raise ValueError(f"{who}: layer {i}'s cache is empty")
        return {"kind": "mlx_lm", "class": "KVCache", "dtype": _name(c.keys.dtype)}
    if isinstance(c, VeloxCache):
        if c.empty() or c.size() != c.offset or c.ragged:
            raise ValueError(
                f"{who}: layer {i}'s {c.method} cache holds {c.size()} of {c.offset} tokens; "
                f"{who} codes caches that keep every token at its position (no eviction)"
            )
        meta = json.loads(c.state[0])
        return {
            "kind": "velox",
            "method": c.method,
            "config": c.config(),
            "dtype": meta["dtype"],
            "io_dtype": meta["io_dtype"],
            "storage_dtype": meta["storage_dtype"],
        }
    raise ValueError(
        f"{who}: layer {i} holds a {type(c).__name__}; {who} codes mlx-lm KVCache and velox "
        "caches that keep every token"
    )


def _check_dtype(layer: dict, name: str, i: int, where: str, optional: bool = False) -> None:
    v = layer.get(name)
    if not (v in _DTYPES or (optional and v is None)):
        raise ValueError(f"{where}: layer {i} {name} {v!r} (allowed: {', '.join(_DTYPES)})")


def _template(layer: dict[str, Any]) -> VeloxCache | None:
    if layer["kind"] == "mlx_lm":
        return None
    name = layer["method"]
    cls = VeloxCache if name == "velox" else get_method(name).cache_class
    cache = cls.from_config(layer["config"])
    if layer["storage_dtype"] is not None:
        cache.set_storage_dtype(_DTYPES[layer["storage_dtype"]])
    return cache


@dataclass(frozen=True)
class StoredTokens:
    """Every layer's keys ``(B, H, T, Dk)`` and values ``(B, H, T, Dv)`` (in the dtype the
    cache stores them in) and its record (module docstring)."""

    kv: list[tuple[mx.array, mx.array]]
    layers: list[dict[str, Any]]

    DTYPES = tuple(_DTYPES)  # the dtypes a record may name

    @staticmethod
    def read(caches: Any, who: str) -> StoredTokens:
        """The tokens of one cache per layer; ``who`` names the caller in errors.

        Raises:
            ValueError: not a non-empty list, a class that cannot be read at every position
                (rotating, quantized or state-space caches; velox caches that evicted tokens
                or keep per-head budgets), or layers of different batch sizes or lengths.
        """
        if not isinstance(caches, (list, tuple)) or not caches:
            raise ValueError(f"{who}: caches must be a non-empty list (one cache per layer)")
        kv, layers = [], []
        for i, c in enumerate(caches):
            layers.append(_describe(i, c, who))
            k, v = c.keys_and_values()
            if isinstance(c, VeloxCache):
                store = _DTYPES[layers[-1]["dtype"]]
                k, v = k.astype(store), v.astype(store)
            if k.ndim != 4 or v.ndim != 4 or k.shape[:3] != v.shape[:3]:
                raise ValueError(f"{who}: layer {i}: keys {k.shape} / values {v.shape} differ")
            if kv and (k.shape[0], k.shape[2]) != (kv[0][0].shape[0], kv[0][0].shape[2]):
                raise ValueError(
                    f"{who}: layer {i} holds (batch, tokens) {(k.shape[0], k.shape[2])}, layer 0 "
                    f"{(kv[0][0].shape[0], kv[0][0].shape[2])}"
                )
            kv.append((k, v))
        return StoredTokens(kv, layers)

    @staticmethod
    def check_records(layers: Any, where: str) -> list[dict[str, Any]]:
        """Layer records read from a file, checked field by field; ``where`` starts each
        error (``"corrupt header"``).

        Raises:
            ValueError: not a non-empty list of records as :meth:`read` writes them.
        """
        if not isinstance(layers, list) or not layers:
            raise ValueError(f"{where}: layers must be a non-empty list")
        for i, layer in enumerate(layers):
            if not isinstance(layer, dict):
                raise ValueError(f"{where}: layer {i} is not an object")
            kind = layer.get("kind")
            if kind == "mlx_lm":
                if set(layer) != {"kind", "class", "dtype"} or layer["class"] != "KVCache":
                    raise ValueError(f"{where}: layer {i} is not an mlx-lm KVCache record")
            elif kind == "velox":
                want = {"kind", "method", "config", "dtype", "io_dtype", "storage_dtype"}
                if set(layer) != want or not isinstance(layer["method"], str):
                    raise ValueError(f"{where}: layer {i} is not a velox cache record")
                if not isinstance(layer["config"], dict):
                    raise ValueError(f"{where}: layer {i}'s config is not an object")
                _check_dtype(layer, "io_dtype", i, where)
                _check_dtype(layer, "storage_dtype", i, where, optional=True)
            else:
                raise ValueError(f"{where}: layer {i} has an unknown kind {kind!r}")
            _check_dtype(layer, "dtype", i, where)
        return layers

    def build(self, model: Any = None, who: str = "velox") -> list:
        """Caches of the recorded classes holding ``kv`` (positions ``0 .. T-1``): mlx-lm
        ``KVCache`` get the tokens as they are (in the recorded dtype); velox caches are made
        again from their settings (through ``make_cache`` when ``model`` is given, which binds
        their codecs to it) and encode the tokens as a prefill would.

        Raises:
            ValueError: the model's caches are not of the recorded kinds, or a recorded
                method cannot be rebuilt (unknown method, bad settings).
        """
        try:
            return self._build(model, who)
        except (KeyError, TypeError) as e:
            why = f"{type(e).__name__}: {e}"
            raise ValueError(f"{who}: cannot rebuild the saved caches ({why})") from None

    def _build(self, model: Any, who: str) -> list:
        layers, kv = self.layers, self.kv
        if model is not None:
            caches = make_cache(model, default=lambda i: _template(layers[i]))
            if len(caches) != len(layers):
                raise ValueError(f"{who}: {len(layers)} saved layers for a model of {len(caches)}")
        else:
            caches = [_template(layer) or KVCache() for layer in layers]
            for i, c in enumerate(caches):
                if isinstance(c, VeloxCache):
                    c.bind(None, i)
            for cls in dict.fromkeys(type(c) for c in caches if isinstance(c, VeloxCache)):
                cls.link_layers(caches)
        for i, (c, layer, (k, v)) in enumerate(zip(caches, layers, kv)):
            want = "velox" if layer["kind"] == "velox" else "mlx_lm"
            if (want == "velox") != isinstance(c, VeloxCache):
                raise ValueError(f"{who}: the model's layer {i} cache is not a {want} cache")
            dt = _DTYPES[layer["io_dtype"] if want == "velox" else layer["dtype"]]
            c.update_and_fetch(k.astype(dt), v.astype(dt))
            mx.eval(c.state[1:] if isinstance(c, VeloxCache) else [c.keys, c.values])
        return caches
