"""RoPE-commutative residual vector quantization of channel pairs.

CommVQ (arXiv 2506.18879, https://arxiv.org/abs/2506.18879) codes a key as a sum of codewords
built from 2x2 blocks ``[[x, y], [-y, x]]``. Such a block is the complex number ``x + i y``
acting on a channel pair, and every 2-D rotation (RoPE's included) is one too, so the two
commute: rotating a decoded pair equals decoding with rotated codes.

Here the ``P = D/2`` channel pairs of a head (in its RoPE layout, :mod:`velox_commvq.rope`)
are cut into ``P / G`` groups of ``G`` consecutive pairs. Stage ``s`` of the residual
quantizer picks, per group, two indices ``c1, c2`` in ``[0, K)``; pair ``p`` of the group then
receives the codeword ``A[s, p, c1] + J B[s, p, c2]`` (``J`` the rotation by 90 degrees, the
second column of the block), so one stage offers ``K**2`` structured codewords per group for
``2 log2(K)`` bits. The key is the sum of its stages' codewords, each stage coding the residual
the earlier ones left (greedy, nearest codeword first).

Shapes used throughout: codebooks ``A``, ``B`` are ``(H, S, P, K, 2)``; grouped residuals
``(B, H, P/G, T, 2G)``; codes ``(B, H, T, S, P/G, 2)`` integers, ``[..., 0]`` = ``c1``.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx

__all__ = ["Geometry", "decode_pairs", "distances", "encode_pairs", "jrot", "jrot_inv"]


@dataclass(frozen=True)
class Geometry:
    """The shape of a fitted quantizer.

    Attributes:
        pairs: RoPE pairs that share one code per stage (``G``).
        entries: entries of each small codebook (``K``, a power of two, 2 to 256).
        stages: residual stages fitted (``S``).
    """

    pairs: int
    entries: int
    stages: int

    @property
    def index_bits(self) -> int:
        return self.entries.bit_length() - 1

    def stages_for(self, bits: int) -> int:
        """Stages that code ``bits`` bits per key coordinate.

        Raises:
            ValueError: when ``bits`` is not a whole number of stages, or needs more stages
                than were fitted.
        """
        # one stage codes 2 * index_bits bits per 2 * pairs coordinates
        n, rem = divmod(bits * self.pairs, self.index_bits)
        if rem or not 1 <= n <= self.stages:
            reach = [
                s * self.index_bits // self.pairs
                for s in range(1, self.stages + 1)
                if s * self.index_bits % self.pairs == 0
            ]
            raise ValueError(
                f"commvq: key_bits={bits} is not reachable with these codebooks ({self.stages} "
                f"stages of {self.index_bits}+{self.index_bits}-bit indices per {self.pairs} "
                f"pairs); reachable key_bits: {reach}. Fit more stages for more bits"
            )
        return n


def jrot(v: mx.array) -> mx.array:
    """``J v``: pairs rotated by +90 degrees, ``(x, y) -> (-y, x)``. Shapes: ``(..., 2)``."""
    return mx.stack([-v[..., 1], v[..., 0]], axis=-1)


def jrot_inv(v: mx.array) -> mx.array:
    """``J^T v``: pairs rotated by -90 degrees, ``(x, y) -> (y, -x)``. Shapes: ``(..., 2)``."""
    return mx.stack([v[..., 1], -v[..., 0]], axis=-1)


def group_codebook(c: mx.array, pairs: int) -> mx.array:
    """One stage's codebook by groups.

    Shapes:
        c ``(H, P, K, 2)``; returns ``(H, P/G, K, 2G)``.
    """
    h, p, k, _ = c.shape
    return (
        c.reshape(h, p // pairs, pairs, k, 2).transpose(0, 1, 3, 2, 4).reshape(h, -1, k, 2 * pairs)
    )


def ungroup_codebook(c: mx.array) -> mx.array:
    """Inverse of :func:`group_codebook`. Shapes: ``(H, n, K, 2G)`` -> ``(H, nG, K, 2)``."""
    h, n, k, c2 = c.shape
    return c.reshape(h, n, k, c2 // 2, 2).transpose(0, 1, 3, 2, 4).reshape(h, -1, k, 2)


def group_pairs(u: mx.array, pairs: int) -> mx.array:
    """Shapes: ``u (B, H, T, P, 2)`` -> ``(B, H, P/G, T, 2G)``."""
    b, h, t, p, _ = u.shape
    return u.reshape(b, h, t, p // pairs, 2 * pairs).transpose(0, 1, 3, 2, 4)


def distances(r: mx.array, a: mx.array, bp: mx.array) -> mx.array:
    """``||r - a_j - bp_k||**2 - ||r||**2`` for every codeword ``(j, k)`` of one stage.

    With ``c = a_j + bp_k`` the square expands into terms in ``j`` alone, ``k`` alone and one
    ``K x K`` cross term of the codebook: two small products with ``r``, never ``K**2``.

    Shapes:
        r ``(B, H, n, T, C)``; a, bp ``(H, n, K, C)`` (``bp = J b``); returns
        ``(B, H, n, T, K, K)`` float32.
    """
    ra = r @ mx.swapaxes(a, -1, -2)  # (B, H, n, T, K)
    rb = r @ mx.swapaxes(bp, -1, -2)
    cross = mx.sum(a * a, -1)[..., :, None] + mx.sum(bp * bp, -1)[..., None, :]
    cross = cross + 2 * (a @ mx.swapaxes(bp, -1, -2))  # (H, n, K, K)
    return cross[:, :, None] - 2 * (ra[..., :, None] + rb[..., None, :])


def _take(c: mx.array, idx: mx.array) -> mx.array:
    """Rows ``c[h, n, idx[b, h, n, t]]``. Shapes: c ``(H, n, K, C)``, idx ``(B, H, n, T)``."""
    b, h, n, t = idx.shape
    rows = mx.broadcast_to(c[None], (b, *c.shape)).reshape(b * h * n, 1, *c.shape[2:])
    got = lookup(rows, idx.reshape(b * h * n, t, 1))  # (B*H*n, T, 1, C)
    return got.reshape(b, h, n, t, c.shape[-1])


def encode_pairs(u: mx.array, a: mx.array, b: mx.array, pairs: int) -> mx.array:
    """Greedy residual coding of channel pairs: each stage takes the nearest of its ``K**2``
    codewords to what the earlier stages left.

    Shapes:
        u ``(B, H, T, P, 2)`` float32; a, b ``(H, S, P, K, 2)``; returns uint8 codes
        ``(B, H, T, S, P/G, 2)``.
    """
    r = group_pairs(u, pairs)
    k = a.shape[3]
    codes = []
    for s in range(a.shape[1]):
        ag = group_codebook(a[:, s].astype(mx.float32), pairs)
        bg = group_codebook(jrot(b[:, s].astype(mx.float32)), pairs)
        d = distances(r, ag, bg)
        best = mx.argmin(d.reshape(*d.shape[:-2], k * k), axis=-1).astype(mx.int32)
        c1, c2 = best // k, best % k  # (B, H, n, T)
        r = r - _take(ag, c1) - _take(bg, c2)
        codes.append(mx.stack([c1, c2], axis=-1))
    out = mx.stack(codes, axis=2)  # (B, H, S, n, T, 2)
    return out.transpose(0, 1, 4, 2, 3, 5).astype(mx.uint8)


def pair_codes(codes: mx.array, pairs: int) -> mx.array:
    """Each group's codes repeated for its pairs.

    Shapes: ``(B, H, T, S, n, 2)`` -> int32 ``(B, H, T, S, n * G, 2)``.
    """
    c = codes.astype(mx.int32)
    return mx.repeat(c, pairs, axis=4)


def lookup(src: mx.array, idx: mx.array) -> mx.array:
    """``out[n, t, p] = src[n, p, idx[n, t, p]]``: one entry per row, token and pair.

    A gather from the flattened table by flat indices, not ``take_along_axis`` over a table
    broadcast along the tokens: on MLX's CUDA backend the latter gives wrong entries once
    the gather is large (about 16,384 heads x tokens of 64 pairs).

    Shapes: src ``(N, P, K, C)``; idx integer ``(N, T, P)``; returns ``(N, T, P, C)``.
    """
    n, p, k, c = src.shape
    base = (mx.arange(n, dtype=mx.int32)[:, None, None] * p + mx.arange(p, dtype=mx.int32)) * k
    flat = (idx.astype(mx.int32) + base).reshape(-1)
    return mx.take(src.reshape(n * p * k, c), flat, axis=0).reshape(*idx.shape, c)


def decode_pairs(codes: mx.array, a: mx.array, b: mx.array, pairs: int) -> mx.array:
    """The sum of each key's codewords, pair by pair (the normalized pre-RoPE key).

    Shapes:
        codes ``(B, H, T, S, P/G, 2)``; a, b ``(H, S, P, K, 2)``; returns float32
        ``(B, H, T, P, 2)``.
    """
    c = pair_codes(codes, pairs)
    bq, h, t = c.shape[:3]
    out = None
    for s in range(a.shape[1]):
        for part, book in ((0, a[:, s]), (1, jrot(b[:, s].astype(mx.float32)))):
            rows = mx.broadcast_to(book.astype(mx.float32)[None], (bq, *book.shape))
            rows = rows.reshape(bq * h, *book.shape[1:])  # (B*H, P, K, 2)
            idx = c[:, :, :, s, :, part].reshape(bq * h, t, -1)  # (B*H, T, P)
            got = lookup(rows, idx).reshape(bq, h, t, -1, 2)
            out = got if out is None else out + got
    return out
