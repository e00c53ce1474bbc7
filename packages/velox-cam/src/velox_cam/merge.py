"""CaM's merge (Zhang et al., ICML 2024, https://proceedings.mlr.press/v235/zhang24n.html):
the probability that an evicted token's value is merged, and the values the kept tokens hold
after a cut that evicts the oldest tokens one at a time.

When the cache evicts its oldest token ``e`` (outside the sinks), CaM samples a mask
``M ~ Bernoulli(p)`` with ``p = clip(A_e / mean(A_{e+1..e+m}), 0, 1)``, ``A`` the attention
each token has accumulated and ``m`` the merge size, and adds ``M * v_e / m`` to the values of
the ``m`` tokens that follow ``e`` (the oldest kept ones). In expectation a query that gives
those tokens their mean attention receives ``p * mean(A) * v_e = A_e * v_e`` from them: the
evicted token's share of the output. Keys are not merged.

A cut of ``n`` tokens at once (a prefill chunk, ``every > 1``) is the same rule applied ``n``
times, oldest first, with the scores of the cut: token ``i`` merges its value, *including what
earlier evictions merged into it*, into tokens ``i+1 .. i+m``. With ``c_i = M_i / m`` the
values after the cut solve the banded recurrence ``u_i = v_i + sum_{i-m <= j < i} c_j u_j``
(``c_j = 0`` for kept tokens). :func:`merged_values` solves it in blocks of ``m`` tokens
(within a block every earlier token is in reach, so the block's inverse has a closed form;
across blocks a doubling scan), with no loop over the evicted tokens.
"""

from __future__ import annotations

import functools

import mlx.core as mx

__all__ = ["merge_probabilities", "merged_values"]


def merge_probabilities(scores: mx.array, n: int, merge: int) -> mx.array:
    """The probability that each of the ``n`` oldest tokens is merged when evicted.

    ``p_i = A_i / mean(A_{i+1} .. A_{i+merge})``, clipped to ``[0, 1]``; a zero mean gives 1
    where ``A_i > 0`` and 0 where ``A_i == 0`` (the authors' ``inf`` clipped to 1 and ``NaN``
    set to 0).

    Shapes:
        scores float32 ``(B, H, T)`` with ``T >= n + merge`` (oldest first); returns float32
        ``(B, H, n)``.
    """
    t = scores.shape[-1]
    if n < 0 or merge < 1 or t < n + merge:
        raise ValueError(
            f"merge_probabilities: {t} scored tokens cannot evict {n} and merge each into "
            f"the {merge} that follow it"
        )
    s = scores.astype(mx.float32)
    mean = mx.mean(mx.take(s, _following(n, merge), axis=-1), axis=-1)  # (B, H, n)
    own = s[..., :n]
    ratio = own / mx.where(mean > 0, mean, 1.0)
    return mx.where(mean > 0, mx.clip(ratio, 0.0, 1.0), (own > 0).astype(mx.float32))


@functools.lru_cache(maxsize=16)
def _following(n: int, merge: int) -> mx.array:
    """The ``merge`` tokens after each of the ``n`` oldest: ``(n, merge)`` indices, made once
    for each cut size (a decode step's cuts share them)."""
    return mx.arange(1, merge + 1)[None, :] + mx.arange(n)[:, None]


def merged_values(values: mx.array, mask: mx.array, merge: int) -> mx.array:
    """The values of the ``merge`` oldest kept tokens after the ``n`` oldest are evicted one
    at a time, each merging ``mask * value / merge`` into the ``merge`` tokens after it.

    Args:
        values: the values of the ``n`` evicted tokens and of the ``merge`` kept tokens after
            them, oldest first.
        mask: whether each evicted token is merged (1) or dropped (0).
        merge: the number of tokens an evicted value is spread over.

    Shapes:
        values ``(B, H, n + merge, D)``, mask ``(B, H, n)`` (or broadcastable to it);
        returns float32 ``(B, H, merge, D)``.
    """
    b, h, length, d = values.shape
    n, m = length - merge, merge
    if n < 0 or m < 1:
        raise ValueError(f"merged_values: {length} values cannot hold merge={merge} kept tokens")
    if n == 1:  # a decode step's cut (every=1): the one value spread over the m after it
        c = mx.broadcast_to(mask.astype(mx.float32), (b, h, 1))[..., None] / m
        v = values.astype(mx.float32)
        return v[:, :, 1:] + c * v[:, :, :1]
    p = -(-length // m)  # blocks of m tokens
    pad = p * m - length
    v = values.astype(mx.float32)
    if pad:
        v = mx.concatenate([v, mx.zeros((b, h, pad, d), dtype=mx.float32)], axis=2)
    c = mx.broadcast_to(mask.astype(mx.float32), (b, h, n)) / m
    c = mx.concatenate([c, mx.zeros((b, h, p * m - n), dtype=mx.float32)], axis=2)
    c = c.reshape(b, h, p, m)
    v = v.reshape(b, h, p, m, d)

    # within a block: u_i = x_i + sum_{j<i} c_j u_j, whose inverse is
    # T[i, j] = c_j * prod_{j<l<i} (1 + c_l) below the diagonal, 1 on it
    grow = mx.cumprod(1.0 + c, axis=-1)  # prod_{l<=i}
    before = grow / (1.0 + c)  # prod_{l<i}
    lower = mx.tril(mx.ones((m, m), dtype=mx.bool_), k=-1)
    t = before[..., :, None] / grow[..., None, :] * c[..., None, :]
    t = mx.where(lower, t, 0.0) + mx.eye(m, dtype=mx.float32)
    # from the block before: token i of block k is within m of token j of block k-1 iff i <= j
    upper = mx.triu(mx.ones((m, m), dtype=mx.float32))
    prev = mx.concatenate([mx.zeros((b, h, 1, m), dtype=mx.float32), c[:, :, :-1]], axis=2)
    cross = upper * prev[..., None, :]  # (B, H, P, m, m)

    # u_k = w_k + a_k u_{k-1}: a doubling scan over the blocks
    w = t @ v
    a = t @ cross
    s = 1
    while s < p:
        w = w + a @ _shift(w, s)
        a = a @ _shift(a, s)
        s *= 2
    u = w.reshape(b, h, p * m, d)
    return u[:, :, n : n + m]


def _shift(x: mx.array, s: int) -> mx.array:
    """``y[:, :, k] = x[:, :, k - s]`` along the blocks (axis 2), zero for ``k < s``."""
    zeros = mx.zeros((*x.shape[:2], s, *x.shape[3:]), dtype=x.dtype)
    return mx.concatenate([zeros, x[:, :, :-s]], axis=2)
