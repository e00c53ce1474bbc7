"""Keyformer's score function: a Gumbel-perturbed, temperature-scaled softmax of the
attention logits (arXiv 2403.09054, section 3.3), and its temperature schedule."""

from __future__ import annotations

import mlx.core as mx

from velox_core.policy.votes import grouped_logits, visible_softmax

__all__ = ["gumbel_votes", "gumbel_weights", "temperature"]


def temperature(step: int, tau_init: float, tau_end: float, steps: int) -> float:
    """The paper's temperature at decode step ``step``: ``tau_init`` for the prompt
    (``step=0``), rising linearly by ``(tau_end - tau_init) / steps`` a step, held at
    ``tau_end`` from step ``steps`` on."""
    return tau_init + min(step, steps) * (tau_end - tau_init) / steps


def gumbel_votes(
    queries: mx.array,
    q_pos: mx.array,
    keys: mx.array,
    k_pos: mx.array,
    scale: float,
    tau: float,
    noise: mx.array,
) -> mx.array:
    """Keyformer's score each query gives each stored token, summed over the queries, per KV
    head: ``softmax((x + g) / tau)`` over the visible tokens, ``x`` the scaled logits and
    ``g`` standard Gumbel noise.

    Args:
        queries: post-RoPE queries; the query heads of KV head ``h`` are ``h * R ... h * R +
            R - 1`` (mlx-lm's grouped layout).
        q_pos: absolute positions of the queries.
        keys: every stored key (post-RoPE).
        k_pos: absolute position of each stored key.
        scale: the model's attention scale.
        tau: the temperature (> 0).
        noise: one Gumbel(0, 1) sample per query head, query and stored token.

    Shapes:
        queries ``(B, Hq, n, D)``, q_pos int ``(n,)``, keys ``(B, H, T, D)`` with ``Hq % H ==
        0``, k_pos int ``(B, H, T)``, noise ``(B, Hq, n, T)``; returns float32 ``(B, H, T)``:
        the sum over the ``n`` queries, the mean over the ``R`` query heads of each KV head.
    """
    x = grouped_logits(queries, keys, scale, "keyformer")  # (B, H, R, n, T)
    y = (x + noise.astype(mx.float32).reshape(x.shape)) / tau
    p = visible_softmax(y, q_pos, k_pos)  # a query that sees nothing scores nothing
    return mx.mean(mx.sum(p, axis=3), axis=2)


def gumbel_weights(weights: mx.array, tau: float, noise: mx.array) -> mx.array:
    """:func:`gumbel_votes` from the softmax attention weights of the queries instead of
    the queries: ``log(weights)`` is each query's logits less its log-sum-exp, a constant
    per query that ``softmax((x + g) / tau)`` does not see, so the scores are the same;
    tokens a query cannot see (weight 0) score 0, as do tokens whose weight underflowed to
    0 in float32 (whose Gumbel scores would be below ``exp(-87 / tau)`` of the largest).

    Shapes:
        weights float32 ``(B, H, R, n, T)``, noise ``(B, H * R, n, T)``; returns float32
        ``(B, H, T)``: the sum over the queries, the mean over the ``R`` query heads.
    """
    b, h, r, n, t = weights.shape
    y = (mx.log(weights) + noise.astype(mx.float32).reshape(b, h, r, n, t)) / tau
    p = mx.softmax(y, axis=-1, precise=True)
    return mx.mean(mx.sum(p, axis=3), axis=2)
