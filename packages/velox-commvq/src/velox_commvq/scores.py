"""Attention scores from CommVQ codes, with RoPE applied in the code domain.

A cached key is ``k = n R(t) sum_s (A[s, c1] + J B[s, c2])`` pair by pair: its norm ``n``, the
rotation ``R(t)`` of RoPE at its position ``t``, and its stages' codewords. In complex notation
(pair ``(x1, x2)`` = ``x1 + i x2``) a query pair meets it as

    q . k = n Re(conj(q) e^{i t theta} sum_s c_s) = n Re(e^{i t theta} sum_s conj(q) c_s)

because ``e^{i t theta}``, ``J = i`` and the codewords are all complex numbers: they commute
(arXiv 2506.18879, https://arxiv.org/abs/2506.18879, Sec. 3.2). So, per decode step:

1. the query meets every codeword once: ``conj(q_p) A[s, p, j]`` and ``conj(q_p) J B[s, p, k]``
   for every head, pair, stage and entry (the q.C tables), summed into the ``K**2`` codewords of
   each stage (additions only);
2. each key looks up, per pair, one table entry per stage and sums them: a 2-vector ``W_p``;
3. RoPE acts on those accumulated 2-vectors by the key's angle, ``Re(e^{i t theta_p} W_p) =
   cos W_p.re - sin W_p.im``, and the pairs add up; the norm scales the sum.

No key is decoded and no key-sized vector is rotated. This is the reference path (pure MLX).
On a GPU the decode kernel does steps 2-3 in one pass over the codes from the per-codeword
tables of step 1 (:func:`codeword_tables`, :mod:`velox_commvq.kernels`).
"""

from __future__ import annotations

import mlx.core as mx

from .vq import jrot, lookup, pair_codes

__all__ = ["code_scores", "codeword_tables", "query_tables"]


def _conj_mul(q: mx.array, c: mx.array) -> mx.array:
    """``conj(q) * c`` of pairs seen as complex numbers. Shapes: ``(..., 2)`` broadcast."""
    q0, q1, c0, c1 = q[..., 0], q[..., 1], c[..., 0], c[..., 1]
    return mx.stack([q0 * c0 + q1 * c1, q0 * c1 - q1 * c0], axis=-1)


def codeword_tables(q: mx.array, a: mx.array, b: mx.array) -> mx.array:
    """The query against each small codebook's entries: ``conj(q_p) A[s, p, k]`` and
    ``conj(q_p) J B[s, p, k]``, ``2 K`` complex numbers per query, stage and pair (a stage's
    ``K**2`` codewords are sums of one of each).

    Shapes:
        q ``(B, H, M, P, 2)`` float32 query pairs; a, b ``(H, S, P, K, 2)``; returns float32
        ``(B, H, M, S, P, 2, K, 2)``: ``[..., 0, k, :]`` from ``A``, ``[..., 1, k, :]`` from
        ``J B``, each ``(real, imaginary)``.
    """
    qq = q[:, :, :, None, :, None]  # (B, H, M, 1, P, 1, 2)
    ta = _conj_mul(qq, a.astype(mx.float32)[None, :, None])  # (B, H, M, S, P, K, 2)
    tb = _conj_mul(qq, jrot(b.astype(mx.float32))[None, :, None])
    return mx.stack([ta, tb], axis=5)


def query_tables(q: mx.array, a: mx.array, b: mx.array) -> mx.array:
    """The query against every codeword of every stage.

    Shapes:
        q ``(B, H, M, P, 2)`` float32 query pairs; a, b ``(H, S, P, K, 2)``; returns
        ``(B, H, S, P, K*K, 2M)``: entry ``c1 * K + c2`` holds ``conj(q) (A[c1] + J B[c2])``,
        real parts for the ``M`` queries, then imaginary parts.
    """
    bq, h, m, p, _ = q.shape
    s, k = a.shape[1], a.shape[3]
    tab = codeword_tables(q, a, b)  # (B, H, M, S, P, 2, K, 2)
    ta, tb = tab[:, :, :, :, :, 0], tab[:, :, :, :, :, 1]  # (B, H, M, S, P, K, 2)
    t = ta[:, :, :, :, :, :, None] + tb[:, :, :, :, :, None]  # (B, H, M, S, P, K, K, 2)
    t = t.reshape(bq, h, m, s, p, k * k, 2).transpose(0, 1, 3, 4, 5, 6, 2)
    return t.reshape(bq, h, s, p, k * k, 2 * m)


def code_scores(
    q: mx.array,
    codes: mx.array,
    norm: mx.array,
    cos: mx.array,
    sin: mx.array,
    a: mx.array,
    b: mx.array,
    pairs: int,
) -> mx.array:
    """``q . k`` for every query and coded key, from the codes.

    Args:
        q: query pairs ``(B, H, M, P, 2)`` float32 (scale applied, RoPE layout).
        codes: ``(B, H, T, S, P/G, 2)`` integer codes.
        norm: ``(B, H, T)`` key norms.
        cos, sin: ``(B, 1, T, P)`` of each key's RoPE angle per pair.
        a, b: codebooks ``(H, S, P, K, 2)``.
        pairs: ``G``, pairs per code.

    Returns:
        float32 ``(B, H, M, T)``.
    """
    m, k = q.shape[2], a.shape[3]
    tables = query_tables(q, a, b)  # (B, H, S, P, K*K, 2M)
    bq, h, _, p, kk, width = tables.shape
    c = pair_codes(codes, pairs)  # (B, H, T, S, P, 2)
    t = c.shape[2]
    idx = c[..., 0] * k + c[..., 1]  # (B, H, T, S, P): one table entry per stage and pair
    w = None
    for s in range(a.shape[1]):
        rows = tables[:, :, s].reshape(bq * h, p, kk, width)
        got = lookup(rows, idx[:, :, :, s].reshape(bq * h, t, p)).reshape(bq, h, t, p, width)
        w = got if w is None else w + got  # (B, H, T, P, 2M)
    rot = cos[..., None] * w[..., :m] - sin[..., None] * w[..., m:]  # RoPE on the sums
    out = mx.sum(rot, axis=3) * norm.astype(mx.float32)[..., None]  # (B, H, T, M)
    return mx.swapaxes(out, -1, -2)
