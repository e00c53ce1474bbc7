"""A model's caches read as KVTC's rows, and rows written back into caches.

KVTC codes a token as two rows (arXiv 2511.01815, Sec. 3): its keys of every layer and KV head
with RoPE undone at the token's position, side by side (layer-major, then head, then channel),
and its values likewise. :func:`read_caches` takes each layer's stored tokens (mlx-lm
``KVCache``, or a velox cache that keeps every token: its decoded tokens) with what
:func:`build_caches` needs to make a cache of the same class and settings again (both through
:class:`velox_core.stored.StoredTokens`, which velox-cachegen shares);
:func:`to_rows` / :func:`from_rows` turn a span of positions into rows and back.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx

from velox_core.ops.rope import RopeSpec, rotate
from velox_core.stored import StoredTokens

__all__ = ["build_caches", "from_rows", "read_caches", "to_rows"]


def read_caches(caches: Any) -> tuple[list[tuple[mx.array, mx.array]], list[dict[str, Any]]]:
    """Every layer's stored keys and values (post-RoPE, positions ``0 .. T-1``) and its record
    (:meth:`velox_core.stored.StoredTokens.read`).

    Raises:
        ValueError: not a non-empty list, a cache KVTC cannot read, or layers of different
            batch sizes or lengths.
    """
    tokens = StoredTokens.read(caches, "kvtc")
    return tokens.kv, tokens.layers


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


def build_caches(
    layers: list[dict[str, Any]], kv: list[tuple[mx.array, mx.array]], model: Any = None
) -> list:
    """Caches of the recorded classes holding ``kv`` (positions ``0 .. T-1``)
    (:meth:`velox_core.stored.StoredTokens.build`)."""
    return StoredTokens(kv, layers).build(model, "kvtc")
