"""ZipCache's token saliency: normalized attention scores from a sample of probe queries.

Accumulated attention (H2O's score: the softmax weight every query gives a token, summed)
favours early tokens: under the causal mask token ``i`` of ``n`` is seen by ``n - i``
queries, so it collects more weight for its position alone. ZipCache (arXiv 2405.14256)
divides the sum by the number of queries that can see the token (the nonzero entries of its
column of the attention matrix): the *normalized attention score*, the mean weight the token
gets from the queries that see it.

Computing it from every query needs the whole ``n x n`` attention matrix, which fast attention
never forms. ZipCache takes the scores of a few *probe* queries instead: the newest 5% of the
queries and 5% drawn at random from the others (``probes=0.1`` here, half of it each way); the
model's own attention runs as usual for every query. :func:`probe_rows` picks the rows and
:func:`normalized_scores` computes the probes' softmax weights over every stored token, adds
them up per token and divides by the probes that see it.

GQA: a KV head's tokens are scored by the mean of its query heads' weights (the authors' code
sums them; the ranking is the same).
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

__all__ = ["SCORE_ELEMENTS", "normalized_scores", "probe_rows", "top_per_block"]

# attention weights formed at once: the probes are taken in blocks of
# SCORE_ELEMENTS // (B * Hq * stored tokens)
SCORE_ELEMENTS = 1 << 20


def probe_rows(n: int, probes: float, seed: int, first: int) -> np.ndarray:
    """The probe queries of a call with ``n`` queries: the newest ``n - int((1 - probes/2) *
    n)`` (at least the last) and ``int(probes/2 * n)`` drawn without replacement from the
    others, the draw seeded by ``seed``, the call's first position ``first`` and ``n`` (so a
    run, its batched twin and a reloaded copy probe the same queries).

    Returns: sorted int64 row indices into the call's queries.
    """
    recent = n - int((1.0 - probes / 2) * n + 1e-9)
    recent = max(1, min(n, recent))
    rest = n - recent
    k = min(int(probes / 2 * n + 1e-9), rest)
    rng = np.random.default_rng([seed, first, n])
    drawn = rng.choice(rest, size=k, replace=False) if k else np.zeros(0, dtype=np.int64)
    return np.sort(np.concatenate([drawn, np.arange(rest, n)]).astype(np.int64))


def normalized_scores(
    queries: mx.array,
    scale: float,
    keys: mx.array,
    rows: np.ndarray,
    cols: tuple[int, int],
    normalize: bool = True,
) -> mx.array:
    """Normalized attention scores of the stored tokens ``cols`` from the probe ``rows``.

    The call's queries are the newest positions: query ``i`` of ``L`` is at position
    ``S - L + i`` and sees stored tokens ``0 .. S - L + i`` (the cache stores every token in
    order, so a token's index is its position).

    Args:
        queries: the call's post-RoPE queries; the query heads of KV head ``h`` are
            ``h * R ... h * R + R - 1`` (mlx-lm's grouped layout).
        scale: the model's attention scale.
        keys: every stored key, decoded, in order.
        rows: the probe rows (:func:`probe_rows`).
        cols: ``(start, stop)``: the tokens to score.
        normalize: divide by the probes that see each token (False: the accumulated score).

    Shapes:
        queries ``(B, Hq, L, D)``, keys float32 ``(B, H, S, D)``; returns float32
        ``(B, H, stop - start)``.
    """
    b, hq, n, d = queries.shape
    h, s = keys.shape[1], keys.shape[2]
    r = hq // h
    c0, c1 = cols
    first = s - n
    k_pos = mx.arange(s)
    kt = mx.swapaxes(keys, -1, -2)
    block = max(1, SCORE_ELEMENTS // max(1, b * hq * s))
    acc = mx.zeros((b, h, c1 - c0), dtype=mx.float32)
    for i in range(0, len(rows), block):
        sel = rows[i : i + block]
        p = len(sel)
        q = queries[:, :, mx.array(sel)].astype(mx.float32) * scale  # (B, Hq, p, D)
        logits = q.reshape(b, h, r * p, d) @ kt  # (B, H, R*p, S)
        seen = k_pos[None, :] <= mx.array(first + sel)[:, None]  # (p, S)
        logits = mx.where(mx.tile(seen, (r, 1)), logits, -mx.inf)
        w = mx.softmax(logits, axis=-1, precise=True).reshape(b, h, r, p, s).mean(axis=2)
        acc = acc + mx.sum(w[..., c0:c1], axis=2)
        if i + block < len(rows):
            mx.eval(acc)  # one block's weights at a time
    if not normalize:
        return acc
    # the probes that see each scored token: those at or after its position
    seen_by = len(rows) - np.searchsorted(first + rows, np.arange(c0, c1), side="left")
    return acc / mx.array(np.maximum(seen_by, 1).astype(np.float32))


def top_per_block(scores: mx.array, group: int, count: int) -> mx.array:
    """The ``count`` highest scores of each block of ``group`` tokens, per row and head.

    Shapes: scores float32 ``(B, H, T)`` with ``T % group == 0``; returns bool ``(B, H, T)``.
    """
    b, h, t = scores.shape
    if count <= 0 or count >= group:
        return mx.full((b, h, t), count >= group, dtype=mx.bool_)
    blocks = scores.reshape(b, h, t // group, group)
    rank = mx.argsort(mx.argsort(-blocks, axis=-1), axis=-1)
    return (rank < count).reshape(b, h, t)
