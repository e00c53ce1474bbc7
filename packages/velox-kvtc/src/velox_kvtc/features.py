"""A model's caches read as KVTC's rows, and rows written back into caches.

KVTC codes a token as two rows (arXiv 2511.01815, Sec. 3): its keys of every layer and KV head
with RoPE undone at the token's position, side by side (layer-major, then head, then channel),
and its values likewise. :func:`read_caches` takes each layer's stored tokens (mlx-lm
``KVCache``, or a velox cache that keeps every token: its decoded tokens) with what
:func:`build_caches` needs to make a cache of the same class and settings again;
:func:`to_rows` / :func:`from_rows` turn a span of positions into rows and back.
"""

from __future__ import annotations

import json
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import KVCache

from velox_core import VeloxCache, get_method, make_cache
from velox_core.ops.rope import RopeSpec, rotate

__all__ = ["build_caches", "describe_layer", "from_rows", "read_caches", "to_rows"]

_DTYPES = {"float16": mx.float16, "bfloat16": mx.bfloat16, "float32": mx.float32}


def _name(dt: mx.Dtype) -> str:
    return str(dt).split(".")[-1]


def describe_layer(i: int, c: Any) -> dict[str, Any]:
    """What rebuilds layer ``i``'s cache: its class (and a velox cache's method, settings and
    dtypes) and the dtype its exact tokens keep.

    Raises:
        ValueError: a class KVTC cannot read at every position (a rotating, quantized or
            state-space cache; a velox cache that evicted tokens or keeps per-head budgets).
    """
    if type(c) is KVCache:
        if c.keys is None:
            raise ValueError(f"kvtc: layer {i}'s cache is empty")
        return {"kind": "mlx_lm", "class": "KVCache", "dtype": _name(c.keys.dtype)}
    if isinstance(c, VeloxCache):
        if c.empty() or c.size() != c.offset or c.ragged:
            raise ValueError(
                f"kvtc: layer {i}'s {c.method} cache holds {c.size()} of {c.offset} tokens; "
                "KVTC codes caches that keep every token at its position (no eviction)"
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
        f"kvtc: layer {i} holds a {type(c).__name__}; KVTC codes mlx-lm KVCache and velox "
        "caches that keep every token"
    )


def read_caches(caches: Any) -> tuple[list[tuple[mx.array, mx.array]], list[dict[str, Any]]]:
    """Every layer's stored keys and values (post-RoPE, positions ``0 .. T-1``) and its
    :func:`describe_layer`.

    Raises:
        ValueError: not a non-empty list, a cache KVTC cannot read, or layers of different
            batch sizes or lengths.
    """
    if not isinstance(caches, (list, tuple)) or not caches:
        raise ValueError("kvtc: caches must be a non-empty list (one cache per layer)")
    kv, layers = [], []
    for i, c in enumerate(caches):
        layers.append(describe_layer(i, c))
        k, v = c.keys_and_values()
        if isinstance(c, VeloxCache):
            store = _DTYPES[layers[-1]["dtype"]]
            k, v = k.astype(store), v.astype(store)
        if k.ndim != 4 or v.ndim != 4 or k.shape[:3] != v.shape[:3]:
            raise ValueError(f"kvtc: layer {i}: keys {k.shape} / values {v.shape} differ")
        if kv and (k.shape[0], k.shape[2]) != (kv[0][0].shape[0], kv[0][0].shape[2]):
            raise ValueError(
                f"kvtc: layer {i} holds (batch, tokens) {(k.shape[0], k.shape[2])}, layer 0 "
                f"{(kv[0][0].shape[0], kv[0][0].shape[2])}"
            )
        kv.append((k, v))
    return kv, layers


def to_rows(
    kv: list[tuple[mx.array, mx.array]], ropes: list[RopeSpec], start: int, stop: int
) -> tuple[mx.array, mx.array]:
    """Rows of positions ``start .. stop - 1``: keys un-rotated at their positions.

    Shapes:
        kv per layer ``(B, H, T, Dk)`` and ``(B, H, T, Dv)``; returns float32 key rows
        ``(B * (stop - start), sum H*Dk)`` and value rows ``(B * (stop - start), sum H*Dv)``,
        batch-major.
    """
    keys, values = [], []
    for (k, v), rope in zip(kv, ropes):
        b, h, _, dk = k.shape
        n = b * (stop - start)
        pre = rotate(k[:, :, start:stop], start, rope, inverse=True)
        keys.append(pre.transpose(0, 2, 1, 3).reshape(n, h * dk))
        vv = v[:, :, start:stop].astype(mx.float32)
        values.append(vv.transpose(0, 2, 1, 3).reshape(n, h * v.shape[3]))
    return mx.concatenate(keys, axis=1), mx.concatenate(values, axis=1)


def from_rows(
    keys: mx.array,
    values: mx.array,
    geometry: list[tuple[int, int, int]],
    ropes: list[RopeSpec],
    batch: int,
    start: int,
) -> list[tuple[mx.array, mx.array]]:
    """Inverse of :func:`to_rows`: each layer's keys (RoPE applied at positions ``start ..``)
    and values.

    Shapes:
        keys ``(B * T, sum H*Dk)``, values ``(B * T, sum H*Dv)``; returns per layer float32
        ``(B, H, T, Dk)`` and ``(B, H, T, Dv)``.
    """
    t = keys.shape[0] // batch
    out, ko, vo = [], 0, 0
    for (h, dk, dv), rope in zip(geometry, ropes):
        k = keys[:, ko : ko + h * dk].reshape(batch, t, h, dk).transpose(0, 2, 1, 3)
        v = values[:, vo : vo + h * dv].reshape(batch, t, h, dv).transpose(0, 2, 1, 3)
        out.append((rotate(k, start, rope), v))
        ko, vo = ko + h * dk, vo + h * dv
    return out


def _template(layer: dict[str, Any]) -> VeloxCache | None:
    if layer["kind"] == "mlx_lm":
        return None
    name = layer["method"]
    cls = VeloxCache if name == "velox" else get_method(name).cache_class
    cache = cls.from_config(layer["config"])
    if layer["storage_dtype"] is not None:
        cache.set_storage_dtype(_DTYPES[layer["storage_dtype"]])
    return cache


def build_caches(
    layers: list[dict[str, Any]], kv: list[tuple[mx.array, mx.array]], model: Any = None
) -> list:
    """Caches of the described classes holding ``kv`` (positions ``0 .. T-1``): mlx-lm
    ``KVCache`` get the tokens as they are; velox caches are made again from their settings
    (through ``make_cache`` when ``model`` is given, which binds their codecs to it) and
    encode the tokens as a prefill would."""
    if model is not None:
        caches = make_cache(model, default=lambda i: _template(layers[i]))
        if len(caches) != len(layers):
            raise ValueError(f"kvtc: {len(layers)} saved layers for a model of {len(caches)}")
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
            raise ValueError(f"kvtc: the model's layer {i} cache is not a {want} cache")
        dt = _DTYPES[layer["io_dtype"] if want == "velox" else layer["dtype"]]
        c.update_and_fetch(k.astype(dt), v.astype(dt))
        mx.eval(c.state[1:] if isinstance(c, VeloxCache) else [c.keys, c.values])
    return caches
