"""AnchorKV's choices as pure functions (arXiv 2608.02901, Sections 3.1 to 3.4).

Every function runs on all batch rows and KV heads at once: ``(B, H, S, D)`` tokens of one
layer's prompt, ``(B, H, m, D)`` observation queries per KV head (the query heads of a KV
head and the window's tokens, ``m = R·n``), each at its absolute position.

* :func:`observe`: the observation queries' softmax weights ``α`` over the exact prompt
  (causal) and their attention outputs ``y``;
* :func:`choose_anchors`: the trailing ``W`` positions, then ``ρ`` of the remaining anchor
  slots by SnapKV's pooled votes, the rest uniformly at random (seeded);
* :func:`project`: each token's anchor of largest absolute cosine (Eq. 1), its coefficient
  ``γ`` (Eq. 2) and its residual;
* :func:`utilities`: the first-order attention-output error of leaving each residual out
  (Eq. 6), for keys and values;
* :func:`residual_slots`: the byte budget (Eq. 9) split between keys and values and pooled
  across the layer's KV heads.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import mlx.core as mx
import numpy as np

from velox_core.policy import pool_votes

__all__ = ["Observed", "choose_anchors", "observe", "project", "residual_slots", "utilities"]

POOL = 7  # SnapKV's pooling kernel (max pooling), as its paper's experiments
TILE = 4096  # prompt tokens projected at once (bounds the (tile, k) cosine matrix)


class Observed(NamedTuple):
    """The observation window over the exact prompt.

    Attributes:
        q: the queries, scaled by the model's attention scale ``(B, H, m, D)`` float32.
        alpha: their softmax weights ``(B, H, m, S)`` float32 (0 past a query's position).
        y: their attention outputs ``(B, H, m, Dv)`` float32.
        votes: SnapKV's votes, the weights summed over the window's tokens and averaged
            over the query heads of each KV head ``(B, H, S)`` float32.
    """

    q: mx.array
    alpha: mx.array
    y: mx.array
    votes: mx.array


def observe(queries: mx.array, q_pos: mx.array, keys: mx.array, values: mx.array, scale: float):
    """The observation queries' attention over the exact prompt (:class:`Observed`).

    Shapes:
        queries ``(B, Hq, n, D)`` post-RoPE, ``Hq`` a multiple of ``H`` (mlx-lm's grouped
        layout); q_pos int ``(n,)``; keys ``(B, H, S, D)`` post-RoPE at positions
        ``0 ... S-1``; values ``(B, H, S, Dv)``.
    """
    b, hq, n, d = queries.shape
    h, s = keys.shape[1], keys.shape[2]
    r = hq // h
    q = (queries.astype(mx.float32) * scale).reshape(b, h, r * n, d)
    logits = q @ mx.swapaxes(keys.astype(mx.float32), -1, -2)  # (B, H, R*n, S)
    visible = mx.arange(s)[None, :] <= mx.tile(q_pos.astype(mx.int32), r)[:, None]
    alpha = mx.softmax(mx.where(visible, logits, -mx.inf), axis=-1, precise=True)
    alpha = mx.where(visible, alpha, 0.0)
    y = alpha @ values.astype(mx.float32)
    votes = mx.mean(mx.sum(alpha.reshape(b, h, r, n, s), axis=3), axis=2)
    return Observed(q, alpha, y, votes)


def choose_anchors(
    votes: mx.array, window: int, anchors: float, rho: float, rng: np.random.Generator
) -> mx.array:
    """Anchor positions of every KV head: the trailing ``window`` positions, and of the
    ``max(window, ⌊anchors·S⌋) - window`` others a share ``rho`` by pooled votes (max
    pooling over ``POOL`` tokens among the earlier tokens, as SnapKV), the rest drawn
    uniformly from the tokens left.

    Shapes:
        votes ``(B, H, S)``; returns int32 ``(B, H, k)``, ascending.
    """
    b, h, s = votes.shape
    w = min(window, s)
    extra = max(w, math.floor(anchors * s)) - w
    extra = min(extra, s - w)
    tail = np.broadcast_to(np.arange(s - w, s), (b, h, w))
    if extra == 0:
        return mx.array(tail.astype(np.int32))
    pos = mx.broadcast_to(mx.arange(s), (b, h, s))
    pooled = pool_votes(votes, pos, pos < s - w, POOL, "max")
    pooled = np.array(pooled[..., : s - w])
    n_top = min(extra, round(rho * extra))
    order = np.argsort(-pooled, axis=-1, kind="stable")
    top = order[..., :n_top]
    draw = rng.random(pooled.shape)
    np.put_along_axis(draw, top, -1.0, axis=-1)  # drawn among the tokens left
    rand = np.argsort(-draw, axis=-1, kind="stable")[..., : extra - n_top]
    chosen = np.concatenate([top, rand, tail], axis=-1)
    return mx.array(np.sort(chosen, axis=-1).astype(np.int32))


class Projected(NamedTuple):
    """One side's anchor-residual form.

    Attributes:
        anchors: the anchor vectors, rounded to the storage dtype ``(B, H, k, D)``.
        index: each token's anchor, an index into ``anchors`` ``(B, H, S)`` int32.
        gamma: each token's coefficient, float16 ``(B, H, S)`` (1 on anchors).
        residual: ``x - γ a`` with the stored (rounded) ``γ`` and ``a`` ``(B, H, S, D)``
            float32 (0 on anchors).
    """

    anchors: mx.array
    index: mx.array
    gamma: mx.array
    residual: mx.array


def project(x: mx.array, at: mx.array, dtype: mx.Dtype) -> Projected:
    """Each token's anchor of largest absolute cosine (Eq. 1) and its projection on it
    (Eq. 2); anchors map to themselves with ``γ = 1``, so they are exact.

    Shapes:
        x ``(B, H, S, D)``; at int ``(B, H, k)`` ascending positions; returns
        :class:`Projected`.
    """
    x = x.astype(mx.float32)
    b, h, s, _ = x.shape
    k = at.shape[-1]
    a = mx.take_along_axis(x, at[..., None], axis=2).astype(dtype)
    a32 = a.astype(mx.float32)
    na2 = mx.sum(a32 * a32, axis=-1)  # (B, H, k)
    na = mx.sqrt(na2)
    idx, gam = [], []
    for t0 in range(0, s, TILE):
        xt = x[:, :, t0 : t0 + TILE]
        dots = xt @ mx.swapaxes(a32, -1, -2)  # (B, H, tile, k)
        nx = mx.sqrt(mx.sum(xt * xt, axis=-1, keepdims=True))
        i = mx.argmax(mx.abs(dots) / (nx * na[:, :, None] + 1e-30), axis=-1)
        g = mx.take_along_axis(dots, i[..., None], axis=-1)[..., 0]
        den = mx.take_along_axis(na2, i, axis=-1)
        idx.append(i.astype(mx.int32))
        gam.append(mx.where(den > 0, g / mx.maximum(den, 1e-30), 0.0))
        mx.eval(idx[-1], gam[-1])  # a tile's cosines freed before the next tile's
    index = mx.concatenate(idx, axis=-1)
    gamma = mx.concatenate(gam, axis=-1)
    own = mx.broadcast_to(mx.arange(k, dtype=mx.int32), (b, h, k))
    index = mx.put_along_axis(index, at, own, axis=-1)
    gamma = mx.put_along_axis(gamma, at, mx.ones((b, h, k)), axis=-1).astype(mx.float16)
    base = gather_rows(a32, index) * gamma.astype(mx.float32)[..., None]
    return Projected(a, index, gamma, x - base)


def gather_rows(a: mx.array, index: mx.array) -> mx.array:
    """``a[b, h, index[b, h, t]]`` for every token.

    Shapes: a ``(B, H, k, D)``, index int ``(B, H, S)``; returns ``(B, H, S, D)``.
    """
    b, h, k, d = a.shape
    flat = index.astype(mx.int32) + (mx.arange(b * h, dtype=mx.int32) * k).reshape(b, h, 1)
    return mx.take(a.reshape(b * h * k, d), flat.reshape(-1), axis=0).reshape(b, h, -1, d)


def utilities(
    obs: Observed, values: mx.array, key_res: mx.array, value_res: mx.array
) -> tuple[mx.array, mx.array]:
    """The attention-output error each residual repairs, to first order (Eq. 6):
    ``u_K = mean_w α² (q·R_t r^K)² ||V_t - y||²`` and ``u_V = mean_w α² ||r^V||²``.

    Shapes:
        values ``(B, H, S, Dv)``; key_res ``(B, H, S, D)`` post-RoPE (``R_t r^K_t``);
        value_res ``(B, H, S, Dv)``; returns two float32 ``(B, H, S)``.
    """
    v = values.astype(mx.float32)
    a2 = obs.alpha * obs.alpha  # (B, H, m, S)
    qr = obs.q @ mx.swapaxes(key_res, -1, -2)  # scaled: the logit's error
    vv = mx.sum(v * v, axis=-1)[:, :, None, :]
    yy = mx.sum(obs.y * obs.y, axis=-1, keepdims=True)
    dv = mx.maximum(vv + yy - 2 * (obs.y @ mx.swapaxes(v, -1, -2)), 0.0)  # ||V_t - y||^2
    u_k = mx.mean(a2 * qr * qr * dv, axis=2)
    u_v = mx.mean(a2, axis=2) * mx.sum(value_res * value_res, axis=-1)
    return u_k, u_v


def residual_slots(
    full: float, base: float, key_bytes: int, value_bytes: int, free: int
) -> tuple[int, int]:
    """Residuals the budget buys for keys and for values (Eq. 9): ``full - base`` bytes split
    evenly, each side's share buying residuals of its own size, at most ``free`` a side (the
    tokens that are not anchors); bytes one side cannot use go to the other.

    Args:
        full: the budget, ``θ·M_full`` bytes.
        base: bytes charged first (anchors and per-token metadata), ``M_base``.
        key_bytes, value_bytes: bytes of one key / value residual (codes, scale, slot).
        free: candidate residuals per side.
    """
    left = max(0.0, full - base)
    nk = min(free, math.floor(left / 2 / key_bytes))
    nv = min(free, math.floor((left - nk * key_bytes) / value_bytes))
    nk = min(free, math.floor((left - nv * value_bytes) / key_bytes))
    return nk, nv
