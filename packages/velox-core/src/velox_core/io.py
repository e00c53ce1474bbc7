"""Saving and loading compressed caches: safetensors with a versioned header.

The file holds every layer's arrays (as stored: packed codes, scales...) and, in the
safetensors metadata, a JSON description of each layer, the layer count, the user metadata
and a SHA-256 over all of that header and every array's name, dtype, shape and bytes.
Loading rebuilds velox caches only through the registered methods, mlx-lm caches only from
a fixed allow-list of plain classes and another host's caches (mlx-vlm's sliding-window layers,
say) only from the classes that host lists (:attr:`velox_core.hosts.Host.saved_classes`);
nothing is unpickled or imported by name from the file.
A truncated, altered or foreign file, an inconsistent layer (a negative offset, more tokens
than its offset), or a file whose layer count differs from the model's (``model=``) raises
``ValueError``.
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets
from collections.abc import Callable
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
from mlx_lm.models import cache as mlx_cache

from .cache.latent import LatentCache
from .cache.state import STATE_VERSION
from .cache.velox import VeloxCache
from .hosts import MLX_LM, get_host, hosts
from .io_check import (
    check_finite_arrays,
    check_host_layer,
    check_layout,
    check_mlx_layer,
    check_round_trip,
    check_velox_layer,
    layer_arrays,
)
from .registry import get_method
from .validation import check_metadata

__all__: list[str] = []

FORMAT = "velox-cache"
VERSION = 2  # 2: the checksum covers the header
_MLX_CLASSES = {
    "KVCache": mlx_cache.KVCache,
    "RotatingKVCache": mlx_cache.RotatingKVCache,
    "QuantizedKVCache": mlx_cache.QuantizedKVCache,
}


_SIGNED = ("format", "version", "n_layers", "layers", "user")  # header fields in the checksum


def _digest(arrays: dict[str, mx.array], header: dict[str, str]) -> str:
    h = hashlib.sha256()
    for key in _SIGNED:
        value = header.get(key, "")
        h.update(f"{key}={len(value)}:".encode() + value.encode())
    for name in sorted(arrays):
        a = arrays[name]
        h.update(name.encode())
        h.update(str(a.dtype).encode() + str(tuple(a.shape)).encode())
        if a.size:
            h.update(np.asarray(mx.contiguous(a).view(mx.uint8)).tobytes())
    return h.hexdigest()


def _encode_layer(i: int, c: Any, arrays: dict[str, mx.array]) -> dict[str, Any]:
    if isinstance(c, VeloxCache):
        record = c.state
        meta = json.loads(record[0])
        for k, a in zip(meta["arrays"], record[1:]):
            arrays[f"layer{i}.{k}"] = a
        return {"kind": "velox", "method": c.method, "meta": meta}
    if isinstance(c, LatentCache):
        meta, *state = c.state
        for j, a in enumerate(state):
            arrays[f"layer{i}.{j}"] = a
        return {"kind": "latent", "meta": json.loads(meta), "arrays": len(state)}
    cls = type(c).__name__
    host = None
    if _MLX_CLASSES.get(cls) is not type(c):
        host = _host_saving(c)
        if host is None:
            raise ValueError(f"cannot save layer {i}: cache class {cls} is not supported")
    items = _items(i, c, arrays)
    if host is not None:
        out = {"kind": "host", "host": host.name, "class": cls, "items": items}
        out["nested"] = _shape(c.state)
        if not hasattr(type(c), "meta_state"):  # mlx-lm's style: from_state(state)
            return out
        meta = c.meta_state
        meta = list(meta) if isinstance(meta, (tuple, list)) else meta
        if not (isinstance(meta, str) or all(isinstance(m, str) for m in meta)):
            raise ValueError(f"cannot save layer {i}: {cls}'s meta_state is not text")
        return {**out, "meta": meta}
    return {"kind": "mlx_lm", "class": cls, "items": items, "nested": _shape(c.state)}


def _host_saving(c: Any):
    """The registered host (other than mlx-lm) that lists ``c``'s class among the caches it
    saves, or None."""
    for host in hosts().values():
        if host is MLX_LM or host.saved_classes is None:
            continue
        if host.saved_classes().get(type(c).__name__) is type(c):
            return host
    return None


def _items(i: int, c: Any, arrays: dict[str, mx.array]) -> list[dict[str, Any]]:
    """``c.state`` flattened: arrays (stored in ``arrays``), None and numbers."""
    items = []
    for j, v in enumerate(_flat(c.state)):
        if isinstance(v, mx.array):
            arrays[f"layer{i}.{j}"] = v
            items.append({"type": "array", "name": f"layer{i}.{j}"})
        elif v is None:
            items.append({"type": "none"})
        elif isinstance(v, (int, float)) and not isinstance(v, bool):
            items.append({"type": "number", "value": v})
        else:
            raise ValueError(f"cannot save layer {i}: state item of type {type(v).__name__}")
    return items


def _flat(state) -> list:
    out = []
    for v in state:
        out.extend(_flat(v) if isinstance(v, (tuple, list)) else [v])
    return out


def _shape(state) -> list:
    return [len(v) if isinstance(v, (tuple, list)) else 0 for v in state]


def _nest(flat: list, shape: list) -> list:
    out, i = [], 0
    for n in shape:
        if n:
            out.append(tuple(flat[i : i + n]))
            i += n
        else:
            out.append(flat[i])
            i += 1
    return out


def save_cache(path: str | Path, caches: list, metadata: dict[str, str] | None = None) -> None:
    """Write a model's caches (velox and plain mlx-lm ones) to ``path`` (``.safetensors``)."""
    if not isinstance(caches, (list, tuple)) or not caches:
        raise ValueError("save_cache: caches must be a non-empty list (one cache per layer)")
    check_metadata(metadata, "save_cache")
    arrays: dict[str, mx.array] = {}
    layers = [_encode_layer(i, c, arrays) for i, c in enumerate(caches)]
    header = {
        "format": FORMAT,
        "version": str(VERSION),
        "n_layers": str(len(layers)),
        "layers": json.dumps(layers),
        "user": json.dumps(metadata or {}),
    }
    header["sha256"] = _digest(arrays, header)
    path = str(path)
    if not path.endswith(".safetensors"):
        raise ValueError(f"save_cache: the file name must end in .safetensors, got {path!r}")
    # mlx appends .safetensors to any other name
    write_atomically(path, lambda tmp: mx.save_safetensors(tmp, arrays, header), ".safetensors")


def write_atomically(
    path: str | os.PathLike, write: Callable[[str], None], suffix: str = ""
) -> None:
    """Replace ``path`` as one step: ``write(tmp)`` writes a fresh file beside it (its name
    ends in ``suffix``, for writers that insist on one), which reaches the disk and is then
    renamed over ``path``. A write that fails or is interrupted leaves the previous file as
    it was, and no temporary file. A symbolic link is followed: its target is replaced, the
    link kept. velox's cache files and the disk stores of velox-kvtc and velox-cachegen are
    written this way."""
    path = os.fspath(path)
    if os.path.islink(path):
        path = os.path.realpath(path)
    folder, name = os.path.split(os.path.abspath(path))
    # a fresh name (not mkstemp) so the file gets the same permissions a direct write would
    tmp = os.path.join(folder, f".{name}.{os.getpid()}-{secrets.token_hex(4)}.tmp{suffix}")
    try:
        write(tmp)
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())  # the bytes reach the disk before the name does
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise


def _read(path: str | Path) -> tuple[dict[str, mx.array], dict[str, str], list[dict]]:
    path = str(path)
    if not Path(path).is_file():
        raise ValueError(f"{path}: no such file")
    try:
        arrays, header = mx.load(path, return_metadata=True)
    except Exception as e:
        raise ValueError(f"{path}: not a readable safetensors file ({e})") from None
    if header.get("format") != FORMAT:
        raise ValueError(f"{path}: not a velox cache file (format {header.get('format')!r})")
    if header.get("version") != str(VERSION):
        raise ValueError(
            f"{path}: unsupported velox cache version {header.get('version')!r} (this velox "
            f"reads version {VERSION}; re-save the cache)"
        )
    if _digest(arrays, header) != header.get("sha256"):
        raise ValueError(f"{path}: checksum mismatch: the file was altered or truncated")
    try:
        layers = json.loads(header["layers"])
        if not isinstance(layers, list) or not all(isinstance(x, dict) for x in layers):
            raise TypeError("layers is not a list of objects")
        if str(len(layers)) != header.get("n_layers"):
            raise TypeError(f"{len(layers)} layers against n_layers {header.get('n_layers')}")
    except (KeyError, TypeError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: corrupt layer header ({e})") from None
    return arrays, header, layers


def _check_layer(path: str, i: int, cache: Any) -> None:
    """Refuse a layer whose counts disagree: a negative offset, more tokens than seen."""
    offset = cache.offset
    tokens = cache.size() if hasattr(cache, "size") else offset
    if not isinstance(offset, int) or offset < 0 or tokens < 0 or tokens > offset:
        raise ValueError(
            f"{path}: layer {i} is inconsistent (offset {offset!r}, {tokens} stored tokens)"
        )


def _rebuilt(where: str, build, state):
    """``build(state)``, any failure of a header the checks let through as a ``ValueError``
    naming the layer (a missing field by its name), never a raw ``KeyError``/``TypeError``."""
    try:
        return build(state)
    except KeyError as e:
        raise ValueError(f"{where}: the header misses field {e.args[0]!r}") from None
    except (TypeError, IndexError, AttributeError, RuntimeError, ValueError) as e:
        text = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        if isinstance(e, ValueError):
            raise ValueError(f"{where}: cannot rebuild the cache from its header: {text}") from None
        raise ValueError(
            f"{where}: {_culprit(e)} is malformed ({type(e).__name__}: {text})"
        ) from None


def _culprit(e: BaseException) -> str:
    """The header field a failure while rebuilding a cache points at, from where it raised:
    a policy's state, a codec's, or the cache's own."""
    import traceback

    files = [f.filename for f in traceback.extract_tb(e.__traceback__)]
    if any(f"{os.sep}policy" in f or "policy.py" in f for f in files):
        return "meta.policy_meta (or a policy.* array)"
    if any(f"{os.sep}codec" in f or "codec.py" in f for f in files):
        return "a codec.* array"
    return "the header's state"


def _load_layer(path: str, i: int, layer: dict, arrays: dict[str, mx.array]) -> Any:
    """One layer's cache, its header checked field by field against its arrays first
    (:mod:`velox_core.io_check`) and, for a velox cache, its codes against its codecs."""
    where = f"{path}: layer {i}"
    prefix = f"layer{i}."
    kind = layer.get("kind")
    if kind == "velox":
        meta = layer.get("meta")
        if not isinstance(meta, dict):
            raise ValueError(f"{where}: meta must be an object")
        layer_arrays(where, meta.get("arrays"), arrays, prefix)
        own = {n: arrays[prefix + n] for n in meta["arrays"]}
        check_velox_layer(where, layer.get("method"), meta, own, STATE_VERSION)
        method = layer["method"]
        cls = VeloxCache if method == "velox" else get_method(method).cache_class
        cache = _rebuilt(where, cls.from_state, [json.dumps(meta), *own.values()])
        if not isinstance(cache, VeloxCache):
            raise ValueError(f"{where}: method {method!r} does not rebuild a velox cache")
        check_round_trip(where, cache, meta, own)
        check_layout(where, cache, meta, own)
        if cache.policy is None and not cache.ragged and cache.size() != cache.offset:
            raise ValueError(
                f"{where}: meta.offset {cache.offset} but {cache.size()} tokens stored (a cache "
                "without a retention policy holds every token it has seen)"
            )
        return cache
    if kind == "latent":
        meta, n = layer.get("meta"), layer.get("arrays")
        count = sum(k.startswith(prefix) for k in arrays)
        if isinstance(n, bool) or not isinstance(n, int) or n != count:
            raise ValueError(f"{where}: arrays must count the layer's {count} arrays, got {n!r}")
        if not isinstance(meta, dict):
            raise ValueError(f"{where}: meta must be an object")
        state = [arrays.get(f"{prefix}{j}") for j in range(n)]
        if any(a is None for a in state):
            raise ValueError(f"{where}: arrays {prefix}0..{n - 1} are not all in the file")
        inner = meta.get("store")
        # one record a token (JointLatent): its own load checks the arrays against the meta
        joint = isinstance(inner, dict) and inner.get("layout") == "joint"
        if inner is not None and not joint:
            names = inner.get("arrays") if isinstance(inner, dict) else None
            if not isinstance(names, list) or len(names) != n:
                raise ValueError(f"{where}: meta.store.arrays must name the {n} arrays")
            own = dict(zip(names, state, strict=True))
            check_velox_layer(f"{where} store", inner.get("method"), inner, own, STATE_VERSION)
        check_finite_arrays(where, {str(j): a for j, a in enumerate(state)})
        return _rebuilt(where, LatentCache.from_state, [json.dumps(meta), *state])
    if kind == "mlx_lm":
        cls = _MLX_CLASSES.get(layer.get("class"))
        if cls is None:
            raise ValueError(f"{where} has unsupported class {layer.get('class')!r}")
        state = _items_state(where, layer, arrays, prefix)
        check_mlx_layer(where, cls.__name__, state)
        return _rebuilt(where, cls.from_state, state)
    if kind == "host":
        cls = _host_class(where, layer)
        state = _items_state(where, layer, arrays, prefix)
        check_host_layer(where, cls.__name__, state)
        if "meta" not in layer:  # a class without meta_state (mlx-lm's style)
            return _rebuilt(where, cls.from_state, state)
        meta = layer["meta"]
        if not (isinstance(meta, str) or (isinstance(meta, list) and _texts(meta))):
            raise ValueError(f"{where} has a bad meta_state {meta!r}")
        meta = meta if isinstance(meta, str) else tuple(meta)
        return _rebuilt(where, lambda st: cls.from_state(st, meta), state)
    raise ValueError(f"{where} has unknown kind {kind!r}")


def _items_state(where: str, layer: dict, arrays: dict[str, mx.array], prefix: str) -> list:
    """A plain (mlx-lm or host) layer's ``state`` from its items and nesting, each item and
    array checked against the file's arrays of that layer."""
    items, nested = layer.get("items"), layer.get("nested")
    if not isinstance(items, list) or not all(isinstance(x, dict) for x in items):
        raise ValueError(f"{where}: items must be a list of objects")
    if (
        not isinstance(nested, list)
        or not all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in nested)
        or sum(max(n, 1) for n in nested) != len(items)
    ):
        raise ValueError(f"{where}: nested {nested!r} does not group the {len(items)} items")
    flat, named = [], set()
    for item in items:
        t = item.get("type")
        if t == "array" and item.get("name") in arrays and item["name"].startswith(prefix):
            flat.append(arrays[item["name"]])
            named.add(item["name"])
        elif t == "none":
            flat.append(None)
        elif t == "number" and isinstance(item.get("value"), int):
            flat.append(item["value"])
        else:
            raise ValueError(f"{where} has a bad state item {item!r}")
    extra = sorted(k for k in arrays if k.startswith(prefix) and k not in named)
    if extra or len(named) < sum(isinstance(x, mx.array) for x in flat):
        raise ValueError(f"{where}: the file's arrays and the layer's items disagree")
    return _nest(flat, nested)


def _texts(meta: list) -> bool:
    return all(isinstance(m, str) for m in meta)


def load_cache(path: str | Path, return_metadata: bool = False, model: Any = None):
    """Read caches written by :func:`save_cache`.

    Args:
        model: when given, the file must hold one cache per layer of this model.

    Returns:
        the list of caches, and the user metadata dict if ``return_metadata``.
    """
    arrays, header, layers = _read(path)
    if model is not None:
        n = len(getattr(model, "layers", ()))
        if n != len(layers):
            raise ValueError(f"{path}: {len(layers)} cached layers for a model of {n} layers")
    out = []
    for i, layer in enumerate(layers):
        out.append(_load_layer(str(path), i, layer, arrays))
        _check_layer(str(path), i, out[-1])
    for cls in dict.fromkeys(type(c) for c in out if isinstance(c, VeloxCache)):
        cls.link_layers(out)  # caches whose layers share state link them again
    if return_metadata:
        return out, json.loads(header.get("user", "{}"))
    return out


def _host_class(where: str, layer: dict) -> type:
    """The class of a host's saved layer, from that host's allow-list only."""
    name = layer.get("host")
    try:
        host = get_host(name) if isinstance(name, str) else None
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from None
    classes = {} if host is None or host.saved_classes is None else host.saved_classes()
    cls = classes.get(layer.get("class"))
    if cls is None:
        raise ValueError(f"{where} has unsupported class {layer.get('class')!r} of host {name!r}")
    return cls


def inspect_cache_file(path: str | Path) -> dict[str, Any]:
    """Summary of a saved cache: method, tokens and bytes per layer. Raises ``ValueError``
    for every file :func:`load_cache` refuses (it is loaded first)."""
    loaded = load_cache(path)
    arrays, header, layers = _read(path)
    rows = []
    for i, layer in enumerate(layers):
        names = [k for k in arrays if k.startswith(f"layer{i}.")]
        nbytes = sum(arrays[k].nbytes for k in names)
        if layer.get("kind") in ("velox", "latent"):
            meta = layer["meta"] if layer["kind"] == "velox" else layer["meta"]["store"] or {}
            stores = meta.get("stores", {})
            tokens = sum(s["tokens"] for n, s in stores.items() if n.endswith(".k"))
            tokens = meta.get("tokens", tokens)  # a latent layer's one record a token
            rows.append(
                {
                    "layer": i,
                    "method": layer.get("method", "latent"),
                    "offset": meta.get("offset", 0),
                    "tokens": tokens,
                    "bytes": nbytes,
                }
            )
        elif layer.get("kind") == "host":
            c = loaded[i]
            rows.append(
                {
                    "layer": i,
                    "method": f"{layer['host']}.{layer['class']}",
                    "offset": c.offset,
                    "tokens": c.size(),
                    "bytes": nbytes,
                }
            )
        else:
            offset = next((it["value"] for it in layer["items"] if it.get("type") == "number"), 0)
            rows.append(
                {
                    "layer": i,
                    "method": layer.get("class"),
                    "offset": offset,
                    "tokens": offset,
                    "bytes": nbytes,
                }
            )
    return {
        "version": header["version"],
        "layers": rows,
        "bytes": sum(r["bytes"] for r in rows),
        "user": json.loads(header.get("user", "{}")),
    }
