"""A compressed cache handed from one process of an ``mx.distributed`` group to another.

**Hand-off.** :func:`send_cache` sends a prefilled model's caches to another process of a
group as they are held (packed codes, scales, fitted arrays: the ``state`` of each cache) and
:func:`recv_cache` rebuilds them there; decoding from the rebuilt caches gives the tokens the
sender's caches would. The bytes sent are the caches' stored arrays plus a small JSON header
(:class:`Sent`).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import KVCache

from .cache.velox import VeloxCache

__all__: list[str] = []

# -- hand-off --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Sent:
    """What :func:`send_cache` moved: ``payload`` bytes of arrays in ``arrays`` messages,
    ``header`` bytes of JSON description (and its 4-byte length), in ``seconds``."""

    payload: int
    header: int
    arrays: int
    seconds: float

    @property
    def total(self) -> int:
        return self.payload + self.header


_MLX = {"KVCache": KVCache}


def _dtype(name: str) -> mx.Dtype:
    dt = getattr(mx, name.rsplit(".", 1)[-1], None)
    if not isinstance(dt, mx.Dtype):
        raise ValueError(f"recv_cache: unknown dtype {name!r} in the header")
    return dt


def _describe(caches: list) -> tuple[list[dict], list[mx.array]]:
    layers, arrays = [], []
    for i, c in enumerate(caches):
        if isinstance(c, VeloxCache):
            meta, *state = c.state
            layers.append({"kind": "velox", "method": c.method, "meta": meta})
        elif type(c) is KVCache:  # its stored tokens, not the buffers' spare capacity
            n = c.offset
            state = [] if c.keys is None else [c.keys[..., :n, :], c.values[..., :n, :]]
            layers.append({"kind": "mlx_lm", "class": "KVCache"})
        else:
            raise ValueError(
                f"send_cache: layer {i}: cannot send a {type(c).__name__} (velox caches and "
                "mlx-lm's KVCache only)"
            )
        layers[-1]["arrays"] = [[str(a.dtype), list(a.shape)] for a in state]
        arrays.extend(state)
    return layers, arrays


def send_cache(caches: list, dst: int, group: mx.distributed.Group | None = None) -> Sent:
    """Send a model's caches (one per layer: velox caches and mlx-lm ``KVCache``) to process
    ``dst`` of ``group``, as stored: the receiver calls :func:`recv_cache` with this process
    as ``src``. Returns what was sent (:class:`Sent`)."""
    if not isinstance(caches, (list, tuple)) or not caches:
        raise ValueError("send_cache: caches must be a non-empty list (one cache per layer)")
    group = group or mx.distributed.init()
    start = time.perf_counter()
    layers, arrays = _describe(caches)
    header = json.dumps({"version": 1, "layers": layers}).encode()
    head = mx.array(list(header), dtype=mx.uint8)
    mx.eval(mx.distributed.send(mx.array([len(header)], dtype=mx.int32), dst, group=group))
    mx.eval(mx.distributed.send(head, dst, group=group))
    payload = sent = 0
    for a in arrays:
        if a.size:
            mx.eval(mx.distributed.send(a, dst, group=group))
            payload += a.nbytes
            sent += 1
    return Sent(payload, len(header) + 4, sent, time.perf_counter() - start)


def recv_cache(src: int, group: mx.distributed.Group | None = None, model: Any = None) -> list:
    """Receive the caches :func:`send_cache` sends from process ``src`` of ``group`` and
    rebuild them (velox caches through their registered methods, as ``load_cache`` does).

    Args:
        model: when given, the caches must be one per layer of it, and get what
            :func:`~velox_core.make_cache` gives that model's caches (``fetch_decoded``).
    """
    from .mlx_lm import ROUTED_ONLY_MODEL_TYPES, _model_type
    from .registry import get_method

    group = group or mx.distributed.init()
    n = mx.distributed.recv((1,), mx.int32, src, group=group)
    head = mx.distributed.recv((int(n.item()),), mx.uint8, src, group=group)
    try:
        desc = json.loads(bytes(memoryview(head)).decode())
        layers = desc["layers"]
        if desc.get("version") != 1 or not isinstance(layers, list):
            raise TypeError("bad version or layers")
    except (KeyError, TypeError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"recv_cache: corrupt header from process {src} ({e})") from None
    out = []
    for i, layer in enumerate(layers):
        state = []
        for dtype, shape in layer["arrays"]:
            dt = _dtype(dtype)
            if 0 in shape:
                state.append(mx.zeros(tuple(shape), dtype=dt))
            else:
                a = mx.distributed.recv(tuple(shape), dt, src, group=group)
                mx.eval(a)
                state.append(a)
        if layer["kind"] == "velox":
            m = layer["method"]
            cls = VeloxCache if m == "velox" else get_method(m).cache_class
            out.append(cls.from_state([layer["meta"], *state]))
        elif layer["kind"] == "mlx_lm" and layer.get("class") in _MLX:
            c = _MLX[layer["class"]]()
            if state:
                c.state = (*state, state[0].shape[2])
            out.append(c)
        else:
            raise ValueError(f"recv_cache: layer {i} has an unknown kind {layer.get('kind')!r}")
    if model is not None:
        n_layers = len(getattr(model, "layers", ()))
        if n_layers != len(out):
            raise ValueError(f"recv_cache: {len(out)} caches for a model of {n_layers} layers")
        if _model_type(model) in ROUTED_ONLY_MODEL_TYPES:
            for c in out:
                if isinstance(c, VeloxCache):
                    c.fetch_decoded = False
    for cls in dict.fromkeys(type(c) for c in out if isinstance(c, VeloxCache)):
        cls.link_layers(out)  # caches whose layers share state link them again
    return out
