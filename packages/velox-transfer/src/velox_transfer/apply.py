"""Applying a mapper: the target model's caches from the source model's, ready to decode.

Chunk by chunk along the tokens: the source layers the mapper reads are taken to content
space at their positions once (from ``max(lags)`` positions before the chunk, for the lagged
regressors: position 0's where a lag reaches before it, as in the fit). For each group of
target layers, the group's source layers are concatenated at its lags (``x``, ``(B, T, F)``)
and projected once (``z = x @ u``, ``(B, T, r)``); each layer of the group maps
``z @ v + b``, the target's RoPE is applied to its keys at the chunk's positions, and the
chunk is written into the target layer's cache through ``update_and_fetch``, as a prefill
chunk would be. The chunk is evaluated once, every layer together. Into a velox cache whose
window is smaller than a chunk, each chunk is encoded as it arrives, so the target's keys and
values are never all resident in fp16 (one chunk of every layer at a time).
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import KVCache

from velox_core import VeloxCache, make, make_cache
from velox_core.validation import check_int

from .mapper import Mapper
from .spec import layer_features, read_caches, split_outputs

__all__ = ["transfer_cache"]


def _target_caches(target: Any, model: Any, mapper: Mapper) -> list:
    n = len(mapper.target.layers)
    if target is None or target == "fp16":
        return [KVCache() for _ in range(n)]
    if isinstance(target, list):
        if len(target) != n:
            raise ValueError(f"target: a list of {len(target)} caches for {n} target layers")
        for i, c in enumerate(target):
            if not isinstance(c, (KVCache, VeloxCache)):  # KVCache subclasses included
                raise TypeError(
                    f"target[{i}] is a {type(c).__name__}; give mlx-lm KVCache or velox caches"
                )
            if (c.keys is not None) if isinstance(c, KVCache) else not c.empty():
                raise ValueError(f"target[{i}] already holds tokens; give empty caches")
        return target
    if model is not None:
        return make_cache(model, default=target)
    if isinstance(target, str):
        out = []
        for i, ls in enumerate(mapper.target.layers):
            c = make(target)
            if isinstance(c, VeloxCache):
                c.bind(None, i)
                c.check_dims(ls.key_dim, ls.value_dim)
            out.append(c)
        return out
    raise TypeError(
        "target must be 'fp16'/None, a velox method spec string, a list of empty caches, or "
        f"(with model=) anything velox_core.make_cache accepts; got {type(target).__name__}"
    )


def transfer_cache(
    source_caches: list,
    mapper: Mapper,
    target: Any = "fp16",
    *,
    model: Any = None,
    source_model: Any = None,
    tokens: int | None = None,
    chunk: int = 512,
    dtype: mx.Dtype = mx.float16,
) -> list:
    """The target model's caches for the tokens in ``source_caches``.

    Args:
        source_caches: the source model's per-layer caches (mlx-lm ``KVCache``, or velox
            caches that evicted nothing), positions ``0 .. T-1``.
        mapper: a fitted or loaded :class:`velox_transfer.Mapper`.
        target: ``"fp16"`` (mlx-lm ``KVCache``), a velox method spec (``"uniform:bits=4"``;
            with ``model=`` anything :func:`velox_core.make_cache` accepts), or a list of
            empty caches to fill.
        model: the target model: checked against the mapper's fingerprint, and used to make
            velox caches (codecs that need the model bind to it).
        source_model: the source model, checked against the mapper's fingerprint if given.
        tokens: map only the first ``tokens`` positions (default: all); the target then
            prefills the rest itself.
        chunk: tokens mapped and written at once.
        dtype: dtype of the mapped keys and values handed to the caches.

    Returns:
        One cache per target layer, ``offset`` equal to the tokens mapped: feed the next token
        to the target model with it (through :func:`velox_core.routed` for velox caches).

    Raises:
        MapperError: models of other fingerprints than the mapper's.
        ValueError, TypeError: caches of another count, class, shape or length, bad arguments.
    """
    if not isinstance(mapper, Mapper):
        raise TypeError(f"mapper must be a velox_transfer.Mapper, got {type(mapper).__name__}")
    chunk = check_int("chunk", chunk, minimum=1)
    if dtype not in (mx.float16, mx.bfloat16, mx.float32):
        raise ValueError(f"dtype must be float16, bfloat16 or float32, got {dtype}")
    mapper.check_models(source_model, model)
    src = read_caches(source_caches, mapper.source, "source")
    total = src[0][0].shape[2]
    n = total if tokens is None else check_int("tokens", tokens, minimum=1)
    if n > total:
        raise ValueError(f"tokens={n}, but the source caches hold {total}")
    out = _target_caches(target, model, mapper)
    maps = [mapper.layer(i) for i in range(len(mapper.target.layers))]  # read and checked
    groups: dict[int, list[int]] = {}  # group -> its target layers
    for i, m in enumerate(maps):
        groups.setdefault(m.group, []).append(i)
    back = max(max(m.lags) for m in maps)
    used = sorted({j for m in maps for j in m.sources})
    for s in range(0, n, chunk):
        e = min(n, s + chunk)
        a = max(0, s - back)  # the first position a lag of this chunk reads
        feats = {  # source layer -> (B, e - a, its features), positions a .. e-1
            j: layer_features(
                src[j][0][:, :, a:e], src[j][1][:, :, a:e], a, mapper.source.layers[j]
            )
            for j in used
        }
        at = mx.arange(s, e)
        for members in groups.values():
            m = maps[members[0]]
            rows = mx.concatenate([feats[j] for j in m.sources], axis=-1)
            x = mx.concatenate(  # (B, e - s, F), lag-major
                [mx.take(rows, mx.maximum(at - lag, 0) - a, axis=1) for lag in m.lags], axis=-1
            )
            z = x @ m.u  # (B, e - s, r): shared by the group's layers
            for i in members:
                y = z @ maps[i].v + maps[i].b
                out[i].update_and_fetch(*split_outputs(y, s, mapper.target.layers[i], dtype))
        mx.eval([c.state[1:] if isinstance(c, VeloxCache) else [c.keys, c.values] for c in out])
    return out
