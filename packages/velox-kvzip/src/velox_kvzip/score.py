"""KVzip's importance of each context KV pair in one reconstruction chunk (arXiv 2505.23416).

A chunk's reconstruction input (the repeat instruction, then the chunk's context tokens,
teacher-forced) runs through the model over the cache, whole or in pieces (attention is
causal, so a query sees the same keys either way). For the scores, each of its queries
takes a softmax over the keys the authors' ``KVScore._get_score`` subsamples: the first
``sink`` stored tokens, the chunk's own context tokens ``[start, end)`` and the
reconstruction tokens themselves (causally). A context pair's score is the largest weight
any reconstruction query of any query head of its KV head's group gives it. With one chunk
covering the whole context (``sink`` 0, or the chunk starting right after the sinks) the
subsampled keys are every stored key, so the softmax is the model's own attention.
"""

from __future__ import annotations

import mlx.core as mx

__all__ = ["SCORE_ELEMENTS", "chunk_scores"]

# attention weights formed at once: the queries are taken in blocks of
# SCORE_ELEMENTS // (B * Hq * subsampled keys), so no chunk x chunk matrix of every head exists
SCORE_ELEMENTS = 1 << 20


def chunk_scores(
    queries: mx.array,
    keys: mx.array,
    scale: float,
    sink: int,
    start: int,
    end: int,
    context: int,
) -> mx.array:
    """The largest softmax weight each context pair of ``[start, end)`` gets from these
    reconstruction queries, per KV head.

    Args:
        queries: the newest reconstruction tokens' post-RoPE queries (the whole input, or
            its latest piece when it is fed in pieces); the query heads of KV head ``h``
            are ``h * R ... h * R + R - 1`` (mlx-lm's grouped layout).
        keys: every stored key in temporal order, index = absolute position: the
            ``context`` tokens, then the reconstruction tokens stored so far (the queries'
            own the newest).
        scale: the model's attention scale.
        sink: leading keys every query also sees (the cache's sinks).
        start, end: the context tokens this chunk reconstructs.
        context: the context's length (the first reconstruction token's position).

    Shapes:
        queries ``(B, Hq, L, D)``, keys ``(B, H, S, D)`` with ``S >= context + L`` and
        ``Hq % H == 0``; returns float32 ``(B, H, end - start)``.
    """
    b, hq, n, d = queries.shape
    h, s = keys.shape[1], keys.shape[2]
    if hq % h:
        raise ValueError(f"kvzip: {hq} query heads is not a multiple of {h} KV heads")
    if not 0 <= sink <= start < end <= context <= s - n:
        raise ValueError(
            f"kvzip: sink={sink}, chunk [{start}, {end}), a {context}-token context and {n} "
            f"reconstruction queries do not fit the {s} stored keys"
        )
    r, c = hq // h, end - start
    first = s - context - n  # reconstruction index of the first query
    parts = [keys[:, :, :sink], keys[:, :, start:end], keys[:, :, context:]]
    sub = mx.concatenate(parts, axis=2).astype(mx.float32)  # (B, H, sink + c + s - context, D)
    q = (queries.astype(mx.float32) * scale).reshape(b, h, r, n, d)
    fixed = sink + c  # keys every reconstruction query sees
    block = max(1, SCORE_ELEMENTS // max(1, b * hq * (fixed + first + n)))
    best = None
    for i in range(0, n, block):
        j = min(i + block, n)
        k = sub[:, :, : fixed + first + j]  # query first + t sees reconstruction 0 .. first + t
        w = q[:, :, :, i:j] @ mx.swapaxes(k, -1, -2)[:, :, None]  # (B, H, R, j - i, keys)
        rows = mx.arange(first + i, first + j)[:, None]
        cols = mx.arange(k.shape[2])[None] - fixed
        w = mx.where(cols <= rows, w, -mx.inf)
        p = mx.softmax(w, axis=-1, precise=True)[..., sink:fixed]
        top = mx.max(p, axis=(2, 3))
        best = top if best is None else mx.maximum(best, top)
        if j < n:
            mx.eval(best)  # one block's weights at a time
    return best
