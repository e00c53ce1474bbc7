"""ChunkKV's selection (arXiv 2502.00299, Algorithm 1): whole chunks of consecutive tokens.

ChunkKV cuts the context into chunks of ``chunk_length`` consecutive tokens, scores each
chunk by the observation window's attention to it, and keeps the best chunks whole (plus the
window itself), so that a kept token keeps the words around it. Here a chunk is a range of
absolute positions, ``chunk_length * i ... chunk_length * (i + 1) - 1`` (chunk ``i``, counted
from the first token of the sequence), so the chunks stay the same from one cut to the next
whatever earlier cuts evicted. Among the tokens a cut may evict (the *candidates*: the body
less the always-kept window), the tokens of one chunk form a *segment*; a segment is a whole
chunk, or the part of one that is present: the chunk at the end of the prompt so far (the
paper's last partial chunk), at the edge of the window or of the sinks, or one whose first
tokens an earlier cut evicted before the rest arrived.

:func:`select_chunks` scores each segment by the **mean** score of its tokens (kvpress's
``ChunkKVPress``: the mean over the chunk, the last partial chunk a chunk of its own; for
whole chunks the paper's sum ranks the same), ranks the segments best first and keeps the
longest run of the ranking whose tokens fit in the budget (the paper keeps
``floor((L_max - w) / c)`` chunks: the same where every chunk is whole), plus the always-kept
tokens. Each row of a batch chooses on its own; rows must keep the same count (the cache
stores them as one array), so a row whose whole segments come to fewer tokens than another
row's is topped up with the leading tokens of its next-ranked segments (one row alone, or rows
whose counts agree, keep whole segments only).
"""

from __future__ import annotations

import mlx.core as mx

__all__ = ["select_chunks"]


def select_chunks(
    scores: mx.array, positions: mx.array, always: mx.array, chunk_length: int, k: int
) -> mx.array:
    """Indices of the body tokens to keep: the always-kept ones and the best whole chunks.

    Args:
        scores: each token's score (higher keeps first); only the candidates' are read.
        positions: the tokens' absolute positions, strictly increasing along each row.
        always: tokens kept whatever their score (the observation window), the same number in
            every row.
        chunk_length: tokens per chunk (positions ``c i ... c i + c - 1`` make chunk ``i``).
        k: tokens to keep per row, the always-kept ones included.

    Returns:
        int32 ``(B, n)``, ascending (temporal order): ``n <= k`` is the largest count of the
        rows' always-kept tokens plus their best segments that fit in ``k`` (every token when
        ``k >= T``).

    Shapes:
        scores float ``(B, T)``, positions int ``(B, T)``, always bool ``(B, T)``.
    """
    b, t = scores.shape
    if k >= t:
        return mx.broadcast_to(mx.arange(t, dtype=mx.int32), (b, t))
    if k <= 0:
        return mx.zeros((b, 0), dtype=mx.int32)
    cand = mx.logical_not(always)
    chunk = positions.astype(mx.int32) // chunk_length
    # a segment starts where the chunk changes or the always-kept tokens begin or end
    cut = (chunk[:, 1:] != chunk[:, :-1]) | (always[:, 1:] != always[:, :-1])
    start = mx.concatenate([mx.ones((b, 1), dtype=mx.bool_), cut], axis=1)
    seg = mx.cumsum(start.astype(mx.int32), axis=1) - 1  # (B, T): the token's segment
    idx = mx.arange(t, dtype=mx.int32)
    first = mx.cummax(mx.where(start, idx, 0), axis=1)  # the segment's first token
    rows = mx.arange(b)[:, None]
    s = mx.where(cand, scores.astype(mx.float32), 0.0)
    sums = mx.zeros((b, t), dtype=mx.float32).at[rows, seg].add(s)
    sizes = mx.zeros((b, t), dtype=mx.int32).at[rows, seg].add(cand.astype(mx.int32))
    means = mx.where(sizes > 0, sums / mx.maximum(sizes, 1).astype(mx.float32), -mx.inf)
    order = mx.argsort(-means, axis=1)  # segments best first (empty and always-kept last)
    ranked = mx.take_along_axis(sizes, order, axis=1)
    n_always = mx.sum(always.astype(mx.int32), axis=1, keepdims=True)
    fits = mx.cumsum(ranked, axis=1) <= k - n_always  # a prefix of the ranking
    n_keep = n_always[:, 0] + mx.sum(mx.where(fits, ranked, 0), axis=1)
    n = min(int(mx.max(n_keep).item()), k)
    # every token's priority: the always-kept first, then segment by rank, each in order
    rank = mx.argsort(order, axis=1)  # the inverse permutation: segment -> rank
    wide = mx.int64 if t * chunk_length + 1 >= 2**31 else mx.int32
    tok_rank = mx.take_along_axis(rank, seg, axis=1).astype(wide)
    prio = mx.where(always, 0, 1 + tok_rank * chunk_length + (idx - first).astype(wide))
    return mx.sort(mx.argsort(prio, axis=1)[:, :n], axis=1).astype(mx.int32)
