"""Comparisons against mlx's own quantization, shared by the method packages' tests."""

from __future__ import annotations

import math

import mlx.core as mx

from .kv import feed, rel_error

__all__ = ["attention_errors_vs_mlx_quant", "fill_chunks"]


def fill_chunks(caches, k: mx.array, v: mx.array, chunk: int = 300) -> None:
    """Feed the same keys and values to every cache, ``chunk`` tokens per update (a prefill
    in chunks, as the comparisons below run it).

    Shapes:
        k, v ``(B, H, T, D)``.
    """
    feed(list(caches), k, v, chunk)


def attention_errors_vs_mlx_quant(
    cache,
    k: mx.array,
    v: mx.array,
    *,
    seed: int,
    stride: int,
    queries: int = 8,
    query_heads: int = 4,
    bits: int = 4,
    group: int = 64,
) -> tuple[float, float]:
    """Mean relative attention-output error of ``cache.attend`` and of mlx's own ``bits``-bit,
    group-``group`` quantization of the same keys and values (``mx.quantize`` /
    ``mx.dequantize``, then fused SDPA), both against fp16 SDPA over ``k`` and ``v``.

    The ``cache`` must already hold ``k`` and ``v``. Decode queries ``(1, query_heads, 1, D)``:
    plain normal ones, and every other one drawn toward the key at ``T - 1 - stride * i``
    (so that some attention is peaked on tokens across the context).

    Returns:
        ``(ours, mlx)`` mean errors over the queries.
    """
    t, d = k.shape[2], k.shape[3]
    scale = 1 / math.sqrt(d)
    kq, vq = (
        mx.dequantize(*mx.quantize(x, group_size=group, bits=bits), group_size=group, bits=bits)
        for x in (k, v)
    )
    ours = theirs = 0.0
    for i in range(queries):
        q = mx.random.normal((1, query_heads, 1, d), key=mx.random.key(seed * 10 + i))
        if i % 2:
            q = q + k[:, :1, t - 1 - stride * i][:, :, None] / 4
        q = q.astype(mx.float16)
        ref = mx.fast.scaled_dot_product_attention(q, k, v, scale=scale)
        ours += rel_error(cache.attend(q, scale=scale), ref)
        theirs += rel_error(mx.fast.scaled_dot_product_attention(q, kq, vq, scale=scale), ref)
    return ours / queries, theirs / queries
