"""SnapKV's observation-window vote (arXiv 2404.14469, section 4), for the policies that score
tokens by it (velox-snapkv, and velox-adakv's base scorer).

* :func:`window_votes`: the softmax attention weights of the window's queries over every
  stored token (each query normalized over the whole context it can see, causally), averaged
  over the query heads that share a KV head (GQA) and fused over the window's queries: summed
  (SnapKV's votes; MorphKV's sum fusion) or their maximum (MorphKV's max fusion, arXiv
  2503.00979, equations 5 and 6).
* :func:`pool_votes`: 1-D pooling of those votes along the tokens, so that a voted token
  brings its neighbours (the paper's "clustering via pooling"). Tokens are neighbours by
  absolute position: on a contiguous prefix this is exactly the paper's ``pool1d`` with
  stride 1 and ``kernel // 2`` zero padding; once earlier cuts have left gaps, an evicted
  neighbour counts as a zero vote instead of letting a token pool with a distant one.
* :class:`WindowVote`: the vote's settings (``observe``, ``kernel``, ``pooling``), checked
  once, as a policy saves them.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx

from ..validation import check_choice, check_int

__all__: list[str] = []

POOLING = ("max", "avg")
# how the window's queries' weights on a token combine: their sum, or the largest of them
FUSIONS = ("sum", "max")


def check_kernel(kernel) -> int:
    """The pooling kernel: an odd int >= 1 (padding ``kernel // 2`` keeps tokens aligned)."""
    check_int("kernel", kernel, minimum=1)
    if kernel % 2 == 0:
        raise ValueError(
            f"kernel must be odd (pooling pads kernel // 2 on each side so each token keeps "
            f"its own score), got {kernel}; use {kernel - 1} or {kernel + 1}"
        )
    return kernel


def check_pooling(pooling) -> str:
    return check_choice("pooling", pooling, POOLING)


def check_fusion(fusion) -> str:
    """How a window's votes fuse over its queries: ``"sum"`` or ``"max"`` (:data:`FUSIONS`)."""
    return check_choice("fusion", fusion, FUSIONS)


def window_votes(
    queries: mx.array,
    q_pos: mx.array,
    keys: mx.array,
    k_pos: mx.array,
    scale: float,
    fusion: str = "sum",
) -> mx.array:
    """Attention the observation window gives each stored token, per KV head.

    Args:
        queries: the window's post-RoPE queries; the query heads of KV head ``h`` are
            ``h * R ... h * R + R - 1`` (mlx-lm's grouped layout).
        q_pos: absolute positions of the queries.
        keys: every stored key (post-RoPE).
        k_pos: absolute position of each stored key.
        scale: the model's attention scale.
        fusion: ``"sum"``, the weights summed over the queries (then averaged over the query
            heads of each KV head), or ``"max"``, the largest weight any one query gives
            (each query's weights first averaged over the query heads of each KV head).

    Shapes:
        queries ``(B, Hq, n, D)``, q_pos int ``(n,)``, keys ``(B, H, T, D)`` with ``Hq % H
        == 0``, k_pos int ``(B, H, T)``; returns float32 ``(B, H, T)``.
    """
    check_fusion(fusion)
    return fuse_weights(window_weights(queries, q_pos, keys, k_pos, scale), fusion)


def window_weights(
    queries: mx.array, q_pos: mx.array, keys: mx.array, k_pos: mx.array, scale: float
) -> mx.array:
    """Each window query's softmax weights over the stored keys it can see, before
    :func:`window_votes` fuses them (arguments as there).

    Shapes:
        queries ``(B, Hq, n, D)``, q_pos int ``(n,)``, keys ``(B, H, T, D)``, k_pos int
        ``(B, H, T)``; returns float32 ``(B, H, R, n, T)``.
    """
    s = grouped_logits(queries, keys, scale, "window_votes")
    return visible_softmax(s, q_pos, k_pos)


def grouped_logits(queries: mx.array, keys: mx.array, scale: float, who: str) -> mx.array:
    """Each query head's scaled attention logits over every key, float32, its query heads
    grouped by KV head (mlx-lm's layout: those of KV head ``h`` are ``h * R ... h * R + R -
    1``); ``ValueError`` naming ``who`` unless ``Hq`` is a multiple of ``H``.

    Shapes:
        queries ``(B, Hq, n, D)``, keys ``(B, H, T, D)``; returns ``(B, H, R, n, T)``.
    """
    b, hq, n, d = queries.shape
    h, t = keys.shape[1], keys.shape[2]
    if hq % h:
        raise ValueError(f"{who}: {hq} query heads is not a multiple of {h} KV heads")
    r = hq // h
    q = (queries.astype(mx.float32) * scale).reshape(b, h, r * n, d)
    return (q @ mx.swapaxes(keys.astype(mx.float32), -1, -2)).reshape(b, h, r, n, t)


def visible_softmax(logits: mx.array, q_pos: mx.array, k_pos: mx.array) -> mx.array:
    """Each query's softmax over the keys it can see (``k_pos <=`` its position), zero on
    the others; a query that sees no key has zero weights (no NaN).

    Shapes:
        logits float32 ``(B, H, R, n, T)`` (:func:`grouped_logits`), q_pos int ``(n,)``,
        k_pos int ``(B, H, T)``; returns float32 ``(B, H, R, n, T)``.
    """
    visible = k_pos[:, :, None, None, :] <= q_pos.reshape(1, 1, 1, q_pos.shape[0], 1)
    p = mx.softmax(mx.where(visible, logits, -mx.inf), axis=-1, precise=True)
    return mx.where(visible, p, 0.0)


def fuse_weights(weights: mx.array, fusion: str = "sum") -> mx.array:
    """The votes of softmax attention weights, per KV head (:func:`window_votes` from the
    weights): ``"sum"`` over the queries, then the mean over the query heads of each KV head;
    ``"max"``, each query's weights first averaged over those heads, the largest of them.

    Shapes:
        weights float32 ``(B, H, R, n, T)`` (``R`` query heads a KV head, ``n`` queries);
        returns float32 ``(B, H, T)``.
    """
    if fusion == "max":
        return mx.max(mx.mean(weights, axis=2), axis=2)
    return mx.mean(mx.sum(weights, axis=3), axis=2)


def _shift(x: mx.array, s: int, fill) -> mx.array:
    """``y[..., i] = x[..., i + s]`` along the last axis, ``fill`` where out of range."""
    pad = mx.full((*x.shape[:-1], abs(s)), fill, dtype=x.dtype)
    if s > 0:
        return mx.concatenate([x[..., s:], pad], axis=-1)
    return mx.concatenate([pad, x[..., :s]], axis=-1)


def pool_votes(
    votes: mx.array,
    positions: mx.array,
    candidate: mx.array | None,
    kernel: int,
    pooling: str,
) -> mx.array:
    """Max or average of the votes of the tokens within ``kernel // 2`` positions.

    Only ``candidate`` tokens contribute (SnapKV pools the prefix's votes alone, not the
    observation window's; None: every token); absent neighbours count as zero (the paper's
    zero padding; ``"avg"`` always divides by ``kernel``, as ``avg_pool1d`` does by default).

    Shapes:
        votes float32 ``(..., T)`` (non-negative), positions int ``(..., T)`` strictly
        increasing along T, candidate bool ``(..., T)`` or None; returns float32 ``(..., T)``.
    """
    check_kernel(kernel)
    check_pooling(pooling)
    v = votes.astype(mx.float32)
    if candidate is not None:
        v = mx.where(candidate, v, 0.0)
    out, half, t = v, kernel // 2, v.shape[-1]
    # positions strictly increase, so a token within `half` positions is within `half` slots
    for step in range(1, min(half, t - 1) + 1):
        for s in (step, -step):
            near = _shift(mx.ones(positions.shape, dtype=mx.bool_), s, False)
            near = near & (mx.abs(_shift(positions, s, 0) - positions) <= half)
            w = mx.where(near, _shift(v, s, 0.0), 0.0)
            out = out + w if pooling == "avg" else mx.maximum(out, w)
    return out / kernel if pooling == "avg" else out


class WindowVote:
    """The vote's settings, checked: the newest ``observe`` queries vote, and their votes are
    pooled over ``kernel`` positions by ``pooling`` (``"max"`` or ``"avg"``).

    A method's config constructs one to check its fields; its policy holds one and saves
    :meth:`config` among its own settings.
    """

    def __init__(self, observe: int = 32, kernel: int = 7, pooling: str = "max"):
        self.observe = check_int("observe", observe, minimum=1)
        self.kernel = check_kernel(kernel)
        self.pooling = check_pooling(pooling)

    def config(self) -> dict[str, Any]:
        return {"observe": self.observe, "kernel": self.kernel, "pooling": self.pooling}

    def pool(self, votes: mx.array, positions: mx.array, candidate: mx.array | None = None):
        """:func:`pool_votes` with these settings (shapes as there)."""
        return pool_votes(votes, positions, candidate, self.kernel, self.pooling)
