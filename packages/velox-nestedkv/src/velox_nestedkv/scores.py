"""NestedKV's scoring rule as pure functions (arXiv 2605.26678, Section 2 and Appendix A).

Every function works along the last axis (tokens) of ``(..., T)`` arrays, so one call scores
every batch row and KV head at once; ranges, scale weights and gates are computed per row,
that is per head (the paper's "head-adaptive" and "within each head").

* :func:`cosine_anomaly`: ``a(i) = -cos(k̂_i, μ)``, the anomaly of a key against an anchor.
* :func:`nested_score`: min-max normalization of the three anomalies, the head-adaptive blend
  ``w = softmax(log w⁰ + β Δ)`` (``Δ`` = mean of the top 10% minus mean of the bottom 10%),
  and the surprise-gated route ``a* = (1 - α) a_blend + α max(ã)`` with
  ``α = σ(κ (s̃ - τ))``, ``s`` the spread of the three normalized anomalies.
* :func:`head_budgets`: the layer-wide competition of (head, token) pairs, after a per-head
  safeguard of each head's own best ``⌊α_s (1 - r) n_h⌋`` tokens.

Constants (``PRIOR``, ``TAIL``, and the defaults β = 3, τ = 0.6, κ = 10) follow secondary
descriptions of the paper's Appendix A; see docs/nestedkv.md.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import mlx.core as mx
import numpy as np

__all__ = [
    "PRIOR",
    "TAIL",
    "NestedScore",
    "block_size",
    "cosine_anomaly",
    "head_budgets",
    "minmax",
    "nested_score",
    "unit",
]

PRIOR = (0.4, 0.4, 0.2)  # log-prior of the (stable, episodic, current) blend weights
TAIL = 0.10  # Δ compares the top and the bottom 10% of a head's normalized anomalies
_EPS = 1e-6  # ranges below this are flat (float32 noise on cosines)


def unit(x: mx.array) -> mx.array:
    """Rows scaled to unit L2 norm (zero rows stay zero). Shapes: ``(..., D)``, float32."""
    x = x.astype(mx.float32)
    n = mx.linalg.norm(x, axis=-1, keepdims=True)
    return x / mx.maximum(n, 1e-12)


def cosine_anomaly(k_hat: mx.array, anchor: mx.array) -> mx.array:
    """``-cos(k̂_i, anchor_i)``: 1 for a key opposite its anchor, -1 for one aligned with it.

    The anchor may be a mean or a sum of unit keys (cosine ignores its scale); a zero anchor
    gives 0.

    Shapes:
        k_hat ``(..., T, D)`` unit rows; anchor ``(..., T, D)`` or ``(..., 1, D)``;
        returns float32 ``(..., T)``.
    """
    dot = mx.sum(k_hat * anchor, axis=-1)
    n = mx.linalg.norm(anchor.astype(mx.float32), axis=-1)
    return -mx.where(n > 0, dot / mx.maximum(n, 1e-30), 0.0)


def minmax(x: mx.array) -> mx.array:
    """Scale each row to ``[0, 1]``; a flat row becomes zeros. Shapes: ``(..., T)``."""
    x = x.astype(mx.float32)
    lo = mx.min(x, axis=-1, keepdims=True)
    span = mx.max(x, axis=-1, keepdims=True) - lo
    return mx.where(span > _EPS, (x - lo) / mx.maximum(span, _EPS), 0.0)


def block_size(n: int) -> int:
    """The paper's episodic block size for ``n`` tokens: ``clip(⌊n / 32⌋, 128, 256)``."""
    return int(min(256, max(128, n // 32)))


class NestedScore(NamedTuple):
    """The final score and what it is made of (all float32).

    Attributes:
        star: ``a*`` ``(..., T)``, higher is kept first.
        blend: the head-adaptive blend ``(..., T)``.
        weights: blend weights ``(3, ...)`` of (stable, episodic, current), per head.
        alpha: the surprise gate ``(..., T)`` (1 routes a token to its strongest scale).
        normalized: the min-max normalized anomalies ``(3, ..., T)``.
    """

    star: mx.array
    blend: mx.array
    weights: mx.array
    alpha: mx.array
    normalized: mx.array


def nested_score(
    a_s: mx.array,
    a_e: mx.array,
    a_c: mx.array,
    *,
    beta: float = 3.0,
    tau: float = 0.6,
    kappa: float = 10.0,
    prior: tuple[float, float, float] = PRIOR,
) -> NestedScore:
    """Combine the stable, episodic and current anomalies of each head's tokens.

    Shapes:
        a_s, a_e, a_c ``(..., T)`` raw anomalies (``T >= 1``); see :class:`NestedScore`.
    """
    a = minmax(mx.stack([a_s, a_e, a_c]))  # (3, ..., T)
    t = a.shape[-1]
    m = max(1, int(TAIL * t))
    srt = mx.sort(a, axis=-1)
    delta = mx.mean(srt[..., t - m :], axis=-1) - mx.mean(srt[..., :m], axis=-1)  # (3, ...)
    logp = mx.array([math.log(p) for p in prior], dtype=mx.float32)
    logp = logp.reshape((3,) + (1,) * (delta.ndim - 1))
    weights = mx.softmax(logp + beta * delta, axis=0)
    blend = mx.sum(weights[..., None] * a, axis=0)
    spread = mx.sqrt(mx.mean((a - mx.mean(a, axis=0)) ** 2, axis=0))  # population std
    s = minmax(spread)
    s = s - mx.mean(s, axis=-1, keepdims=True)
    alpha = mx.sigmoid(kappa * (s - tau))
    star = (1.0 - alpha) * blend + alpha * mx.max(a, axis=0)
    return NestedScore(star, blend, weights, alpha, a)


def head_budgets(scores: list[mx.array], total: int, safeguard: float) -> list[mx.array]:
    """Share ``total`` kept tokens among the heads of one layer (batch 1).

    Each head first keeps its own best ``⌊safeguard · (1 - r) · n_h⌋`` tokens, where
    ``1 - r = total / Σ n_h`` is the layer's keep ratio; the rest of the budget goes to the
    best remaining (head, token) pairs of the whole layer. Ties go to the earlier token and
    the lower head.

    Args:
        scores: one ``(n_h,)`` (or ``(1, n_h)``) score array per KV head.
        total: tokens to keep over all heads.
        safeguard: the per-head guaranteed fraction ``α_s``.

    Returns:
        One int32 ``(k_h,)`` array of ascending indices per head, ``Σ k_h = min(total, Σ n_h)``.
    """
    s = [np.asarray(x.astype(mx.float32)).reshape(-1) for x in scores]
    n = [len(x) for x in s]
    if total >= sum(n):
        return [mx.arange(k, dtype=mx.int32) for k in n]
    keep_ratio = total / sum(n)
    ranked = []
    for h, x in enumerate(s):
        order = np.argsort(-x, kind="stable")
        floor = int(safeguard * keep_ratio * len(x))
        rank_key = x.astype(np.float64).copy()
        rank_key[order[:floor]] = np.inf  # the safeguard: always kept
        ranked.append((rank_key, np.full(len(x), h), np.arange(len(x))))
    key = np.concatenate([r[0] for r in ranked])
    head = np.concatenate([r[1] for r in ranked])
    idx = np.concatenate([r[2] for r in ranked])
    chosen = np.argsort(-key, kind="stable")[:total]
    return [
        mx.array(np.sort(idx[chosen][head[chosen] == h]).astype(np.int32)) for h in range(len(s))
    ]
