"""The RaBitQ code of a rotated vector: the sign code (1 bit) and the extended code (B bits).

RaBitQ (arXiv 2405.12497, Section 3.1) quantizes a unit vector ``o`` to the nearest vector of
a randomly rotated codebook: with the rotation ``P`` applied to the data instead of the
codebook, the code of ``o' = P^-1 o`` is the vertex ``sign(o') / sqrt(D)`` of the hypercube,
the one with the largest inner product with ``o'`` (Equations 5 to 8).

Extended RaBitQ (arXiv 2409.09913, Section 3) uses ``B`` bits per coordinate: the codebook is
the grid ``{-(2^B - 1)/2, ..., -1/2, 1/2, ..., (2^B - 1)/2}^D`` normalized onto the unit sphere,
and the code of ``o'`` is the grid point ``y`` of largest cosine ``<y, o'> / ||y||``. Every
candidate is the grid point nearest to ``t * o'`` for some rescale factor ``t > 0``: per
coordinate, the sign of ``o'_i`` and the magnitude ``k_i + 1/2`` with
``k_i = min(floor(t |o'_i|), 2^(B-1) - 1)``. As ``t`` grows, ``k_i`` steps up at the critical
values ``t = (j + 1) / |o'_i|``; between two of them the candidate does not change. The paper
enumerates the critical values in increasing order and keeps the best candidate; here all of
them are enumerated at once (sorted, with running sums of ``<y, |o'|>`` and ``||y||^2``), so the
code is the exact maximizer. With ``B = 1`` the grid is ``{-1/2, 1/2}^D``: the sign code.

Stored code: ``u_i = y_i + (2^B - 1)/2`` in ``[0, 2^B)``, whose top bit is the sign bit of
RaBitQ and whose lower ``B - 1`` bits are the extended code (mirrored for negative
coordinates, as the authors' library lays them out).
"""

from __future__ import annotations

import mlx.core as mx

__all__ = ["MAX_EVENTS", "grid", "quantize"]

# most (rows x critical values) one call sorts at once: long inputs go in row chunks
MAX_EVENTS = 1 << 19


def grid(codes: mx.array, bits: int) -> mx.array:
    """The grid point ``y = u - (2^B - 1)/2`` of codes ``u``.

    Shapes:
        codes ``(..., D)`` integers in ``[0, 2^bits)``; returns float32 ``(..., D)``.
    """
    return codes.astype(mx.float32) - ((1 << bits) - 1) / 2


def _levels(a: mx.array, top: int) -> mx.array:
    """Per coordinate ``k_i`` of the best candidate for magnitudes ``a`` (``top = 2^(B-1) - 1``).

    Shapes:
        a ``(R, D)`` float32, nonnegative; returns int32 ``(R, D)`` in ``[0, top]``.
    """
    r, d = a.shape
    steps = mx.arange(1, top + 1, dtype=mx.float32)  # k_i steps from j - 1 to j at t = j / a_i
    t = steps[None, None, :] / mx.maximum(a, 1e-30)[..., None]  # (R, D, top), finite
    t = t.reshape(r, d * top)
    order = mx.argsort(t, axis=-1)
    # what each step adds: a_i to <y, a>, and (j + 1/2)^2 - (j - 1/2)^2 = 2j to ||y||^2
    gain = mx.take_along_axis(mx.repeat(a, top, axis=-1), order, axis=-1)
    grow = mx.take(mx.tile(2 * steps, d), order)
    start = 0.5 * mx.sum(a, axis=-1, keepdims=True)  # <y, a> of the sign code
    num = mx.concatenate([start, start + mx.cumsum(gain, axis=-1)], axis=-1)
    den = mx.concatenate([mx.zeros((r, 1)), mx.cumsum(grow, axis=-1)], axis=-1) + 0.25 * d
    cos = num / mx.sqrt(den)  # the cosine (up to ||a||) after each step, in order
    best = mx.argmax(cos, axis=-1, keepdims=True)  # 0: no step taken (the sign code)
    rank = mx.put_along_axis(
        mx.zeros((r, d * top), dtype=mx.int32),
        order,
        mx.broadcast_to(mx.arange(1, d * top + 1, dtype=mx.int32), (r, d * top)),
        axis=-1,
    )  # rank[e]: position (from 1) of step e in increasing t
    taken = (rank <= best).astype(mx.int32).reshape(r, d, top)
    return mx.sum(taken, axis=-1)


def quantize(o: mx.array, bits: int) -> tuple[mx.array, mx.array]:
    """The ``bits``-bit RaBitQ codes of rotated vectors, and ``<o_bar, o>``.

    The scale of ``o`` does not matter (the code depends on its direction only).

    Shapes:
        o ``(..., D)`` float32; returns codes uint8 ``(..., D)`` in ``[0, 2^bits)`` and
        ``<o_bar, o> = <y, o> / (||y|| ||o||)`` float32 ``(...)`` (1 for a zero vector, whose
        score needs no correction).
    """
    lead, d = o.shape[:-1], o.shape[-1]
    flat = o.reshape(-1, d)
    a = mx.abs(flat)
    top = (1 << (bits - 1)) - 1
    if top == 0:
        k = mx.zeros(flat.shape, dtype=mx.int32)
    else:
        step = max(1, MAX_EVENTS // (d * top))
        rows = flat.shape[0]
        k = mx.concatenate([_levels(a[i : i + step], top) for i in range(0, rows, step)])
    half = 1 << (bits - 1)
    pos = flat >= 0
    codes = mx.where(pos, half + k, half - 1 - k)
    y = grid(codes, bits)
    ip = mx.sum(y * flat, axis=-1) / (mx.linalg.norm(y, axis=-1) * mx.linalg.norm(flat, axis=-1))
    ip = mx.where(mx.isfinite(ip) & (ip > 0), ip, 1.0)
    return codes.astype(mx.uint8).reshape(*lead, d), ip.reshape(lead)
