"""velox caches under mlx-lm's distributed inference, and a compressed cache hand-off.

**Sharded models.** ``model.shard(group)`` (mlx-lm's tensor parallelism: llama, qwen2 and
others) splits every attention layer by heads: each process stores only its share of the KV
heads, and :func:`~velox_core.make_cache` there builds caches of those heads. A method whose
caches treat each KV head on its own (quantizers, per-head eviction, ...) then holds on each
process exactly the heads' part of what it holds on one machine, and decodes the same tokens.
A method that mixes heads (a budget shared among a layer's heads, scores averaged over all
heads, channels permuted across heads, an SVD of all heads' channels) or needs an artifact
fitted on the whole model cannot be split so: :func:`split_refusal` names why, and
``make_cache`` raises with it. ``model.model.pipeline(group)`` (mlx-lm's pipeline stages)
keeps some layers per process; methods that link layers (a pyramid of budgets, cross-layer
merging) are refused there, and so is a velox cache on a stage's last layer, whose ``keys``
mlx-lm ties its send of the hidden state to (``layers={-1: None}`` keeps that layer fp16).

Each method states its own answer: the ``split_refusal(config, by_heads, pipelined)``
classmethod of its cache class returns the reason ("" where it can be split; the default of
:class:`~velox_core.VeloxCache`), and this module adds what holds for every method (layers
linked across a pipeline's stages, a stage's last layer).

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

__all__ = [
    "FITTED_ON_WHOLE_MODEL",
    "Sent",
    "model_kv_heads",
    "pipeline_stage",
    "recv_cache",
    "send_cache",
    "split_refusal",
]

# the reason a method needing an artifact fitted on the whole model gives (its
# split_refusal): the artifact is found by the model's fingerprint, which splitting changes
FITTED_ON_WHOLE_MODEL = (
    "it needs an artifact fitted on the whole model (found by the model's fingerprint, which "
    "splitting changes); slicing it per process is not implemented"
)


def model_kv_heads(model: Any) -> int | None:
    """The model's KV heads per layer from its config (``num_key_value_heads``, else
    ``num_attention_heads``); None where the config has neither."""
    args = getattr(model, "args", None)
    for name in ("num_key_value_heads", "num_attention_heads"):
        v = args.get(name) if isinstance(args, dict) else getattr(args, name, None)
        if isinstance(v, int) and not isinstance(v, bool) and v > 0:
            return v
    return None


def pipeline_stage(model: Any) -> tuple[int, int] | None:
    """``(rank, stages)`` of a model split by mlx-lm's ``pipeline`` into more than one
    stage, else None."""
    inner = getattr(model, "model", None)
    size = getattr(inner, "pipeline_size", 1)
    if isinstance(size, int) and size > 1:
        return int(getattr(inner, "pipeline_rank", 0)), size
    return None


def _links_layers(cache: VeloxCache) -> bool:
    own = getattr(type(cache).link_layers, "__func__", None)
    return own is not getattr(VeloxCache.link_layers, "__func__", None)


def split_refusal(model: Any, layer: int, route: Any, cache: VeloxCache) -> str:
    """Why ``cache`` cannot serve ``layer`` of ``model`` where the model is split over
    processes ("" where it can, and on a model that is not split).

    ``route`` is the layer's :class:`~velox_core.mlx_lm.Route`: a layer that stores fewer KV
    heads than the model's config has is split by heads (``model.shard``).
    """
    total = model_kv_heads(model)
    local = getattr(route, "kv_heads", None)
    by_heads = total is not None and local is not None and local < total
    stage = pipeline_stage(model)
    if not by_heads and stage is None:
        return ""
    where = []
    if by_heads:
        where.append(f"sharded by heads ({local} of the model's {total} KV heads here)")
    if stage is not None:
        where.append(f"split into pipeline stages (stage {stage[0]} of {stage[1]})")
    head = f"{cache.method} cannot run on a model {' and '.join(where)}: "
    own = type(cache).split_refusal(cache.config(), by_heads, stage is not None)
    if own:
        return head + own
    if stage is not None:
        if _links_layers(cache):
            return head + (
                "its caches are linked across the model's layers, and a stage holds only some "
                "of them"
            )
        if layer == len(model.layers) - 1:
            return head + (
                "mlx-lm ties its send of a stage's hidden state to the last layer's "
                "cache.keys, which a velox cache does not have; keep that layer fp16 with "
                "layers={-1: None}"
            )
    return ""


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
