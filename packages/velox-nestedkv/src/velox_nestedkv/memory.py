"""NestedKV's three key memories, kept as running statistics while tokens stream in.

The paper computes its anchors once over the whole prompt (Section 2.2): the stable anchor
``μ_s`` is the mean unit key of all tokens, the episodic anchor ``μ_e(i)`` the mean unit key
of token ``i``'s block (contiguous blocks of ``b`` tokens), the current anchor ``μ_c(i)`` the
mean unit key of the ``W`` tokens ending at ``i``. A streaming cache evicts between chunks, so
the anchors are kept as running sums over *every* token seen, evicted ones included:

* ``stable``: the sum of all unit keys ``(B, H, D)``;
* ``open``: the sum of the unit keys of the block still being filled ``(B, H, D)``;
* ``recent``: the last ``W - 1`` unit keys ``(B, H, W-1, D)`` (fp16), to continue ``μ_c``;
* per stored token, its current anomaly ``a_c`` (fixed once its window is complete: it looks
  only backwards) and its episodic anomaly ``a_e`` (final once its block is closed), fp16.

:func:`absorb` adds a run of consecutive new unit keys to these sums and returns the anomalies
of the new tokens, and the block sums needed to refresh older tokens of the open block.
"""

from __future__ import annotations

from typing import NamedTuple

import mlx.core as mx

from .scores import cosine_anomaly

__all__ = ["Absorbed", "absorb"]


class Absorbed(NamedTuple):
    """What :func:`absorb` returns.

    Attributes:
        stable, open, recent: the updated running statistics (see the module docstring).
        a_c, a_e: anomalies of the new tokens ``(B, H, n)`` float32.
        first_block: the block sum, after the update, of the block that was open before it
            ``(B, H, D)``, for older stored tokens of that block.
    """

    stable: mx.array
    open: mx.array
    recent: mx.array | None
    a_c: mx.array
    a_e: mx.array
    first_block: mx.array


def absorb(
    u: mx.array,
    seen: int,
    stable: mx.array | None,
    open_sum: mx.array | None,
    recent: mx.array | None,
    window: int,
    block: int,
) -> Absorbed:
    """Absorb the unit keys of positions ``[seen, seen + n)``.

    Args:
        u: new unit keys ``(B, H, n, D)`` float32, ``n >= 1``.
        seen: absolute position of the first of them (every earlier token was absorbed).
        stable, open_sum, recent: the current statistics (None before the first token).
        window: ``W``, the current memory's span.
        block: ``b``, the episodic block size (blocks are ``[j b, (j + 1) b)``).
    """
    b_, h_, n, d = u.shape
    zeros = mx.zeros((b_, h_, d), dtype=mx.float32)
    stable = (zeros if stable is None else stable) + mx.sum(u, axis=2)

    # current: trailing window sums from a prefix sum over [recent | new]
    prev = mx.zeros((b_, h_, 0, d), mx.float32) if recent is None else recent.astype(mx.float32)
    seq = mx.concatenate([prev, u], axis=2)
    csum = mx.concatenate([mx.zeros((b_, h_, 1, d)), mx.cumsum(seq, axis=2)], axis=2)
    hi = mx.arange(prev.shape[2] + 1, prev.shape[2] + n + 1)
    lo = mx.maximum(hi - window, 0)
    a_c = cosine_anomaly(u, csum[:, :, hi] - csum[:, :, lo])
    keep = min(window - 1, seq.shape[2])
    recent = seq[:, :, seq.shape[2] - keep :].astype(mx.float16) if keep > 0 else None

    # episodic: sums of the touched blocks (the open one continues with `open_sum`)
    pre = seen % block
    nb = -(-(pre + n) // block)
    pad = nb * block - pre - n
    padded = mx.concatenate(
        [mx.zeros((b_, h_, pre, d)), u, mx.zeros((b_, h_, pad, d))], axis=2
    ).reshape(b_, h_, nb, block, d)
    sums = mx.sum(padded, axis=3)  # (B, H, nb, D)
    if open_sum is not None:
        sums = mx.concatenate([sums[:, :, :1] + open_sum[:, :, None], sums[:, :, 1:]], axis=2)
    a_e = cosine_anomaly(padded, sums[:, :, :, None]).reshape(b_, h_, nb * block)
    a_e = a_e[:, :, pre : pre + n]
    open_sum = zeros if (pre + n) % block == 0 else sums[:, :, -1]
    return Absorbed(stable, open_sum, recent, a_c, a_e, sums[:, :, 0])
