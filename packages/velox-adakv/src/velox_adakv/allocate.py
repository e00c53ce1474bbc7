"""Ada-KV's head-wise budget allocation (arXiv 2407.11550, Algorithm 1 with its safeguard).

Ada-KV bounds the L1 error of a layer's attention output after eviction by a constant minus
the attention mass the kept tokens carry, summed over heads. A uniform split maximizes that
mass head by head under ``k`` tokens each; Ada-KV maximizes it over the layer under the same
total ``H x k``: it takes the ``H x k`` highest scores of all heads jointly, and a head's
budget is the number of its tokens among them. Heads whose attention is concentrated on a few
tokens reach most of their mass with few tokens and give budget to heads whose attention is
spread out. The safeguard keeps each head's ``floor(alpha x k)`` best tokens first (so no head
is starved when scores are only estimates); the rest of the layer budget is chosen jointly.

Safeguard form: this is NVIDIA kvpress's ``AdaKVPress`` (reviewed by the first author,
``alpha_safeguard = 0.2``). The authors' original code scales the joint top-k counts instead,
``n_h = round(alpha x k + (1 - alpha) x c_h)``; both keep at least ``alpha`` of the uniform
share per head and the layer total.
"""

from __future__ import annotations

import mlx.core as mx

from velox_core.policy import top_k_sorted

__all__ = ["adaptive_keep", "allocate"]


def _safeguarded(scores: list[mx.array], k: int, alpha: float) -> list[mx.array]:
    """Each head's ``floor(alpha x k)`` best scores raised to +inf (always selected)."""
    floor_k = int(alpha * k)
    out = []
    for s in scores:
        m = min(floor_k, s.shape[-1])
        if m == 0:
            out.append(s)
            continue
        best = mx.argpartition(-s, kth=m - 1)[:m]
        out.append(s.at[best].add(mx.inf))
    return out


def allocate(scores: list[mx.array], k: int, alpha: float) -> list[int]:
    """Per-head budgets summing to the layer budget ``len(scores) x k``.

    Args:
        scores: one float32 ``(T_h,)`` score array per KV head (higher keeps); lengths may
            differ.
        k: the uniform share (body tokens per head).
        alpha: the safeguard fraction in ``[0, 1]`` (1.0 gives every head ``k``).

    Returns:
        ``n_h`` per head, with ``sum(n_h) == H x k`` (or every token when fewer are held),
        ``n_h >= min(floor(alpha x k), T_h)`` and ``n_h <= T_h``.
    """
    sizes = [int(s.shape[-1]) for s in scores]
    total = len(scores) * k
    if sum(sizes) <= total:
        return sizes
    flat = mx.concatenate([s.astype(mx.float32) for s in _safeguarded(scores, k, alpha)])
    head = mx.concatenate([mx.full((n,), i, dtype=mx.int32) for i, n in enumerate(sizes)])
    chosen = mx.argpartition(-flat, kth=total - 1)[:total]
    counts = mx.zeros((len(sizes),), dtype=mx.int32).at[head[chosen]].add(1)
    return counts.tolist()


def adaptive_keep(scores: list[mx.array], k: int, alpha: float) -> list[mx.array]:
    """The tokens each head keeps under :func:`allocate`: ascending int32 ``(n_h,)`` indices.

    Within a head the ``n_h`` best scores are kept (the safeguarded ones among them), which
    is the joint selection up to ties.
    """
    scores = [s.astype(mx.float32) for s in scores]
    counts = allocate(scores, k, alpha)
    return [top_k_sorted(s, n) for s, n in zip(_safeguarded(scores, k, alpha), counts)]
