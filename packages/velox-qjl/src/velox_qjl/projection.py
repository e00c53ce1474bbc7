"""The QJL projection, its estimator and estimator constant, and outlier-channel selection.

QJL (arXiv 2406.03482, Definition 3.1) draws ``S`` with i.i.d. ``N(0, 1)`` entries, stores
``sign(S k)`` and ``||k||``, and estimates ``<q, k>`` by ``c / m * ||k|| * <S q, sign(S k)>``
with ``c = sqrt(pi / 2)`` (Lemma 3.2: ``E|<s, k>| = sqrt(2 / pi) ||k||`` for a Gaussian row).

Section 4.1 orthogonalizes the rows of ``S`` (QR, in blocks of ``d`` rows, rescaled to norm
``sqrt(d)``, as the authors' ``QJLSketch.init_rot_dir``). A row is then uniform on the sphere
of radius ``sqrt(d)``, so ``E|<s, k>| = sqrt(d) * c_d * ||k||`` with
``c_d = Gamma(d / 2) / (sqrt(pi) * Gamma((d + 1) / 2))`` (the mean of ``|u_1|`` for ``u``
uniform on the unit sphere); using ``c = 1 / (sqrt(d) * c_d)`` keeps the estimator exactly
unbiased (the authors keep ``sqrt(pi / 2)``, off by about ``1 / (4 d)``: 0.2% at ``d = 128``).
"""

from __future__ import annotations

import math

import mlx.core as mx
import numpy as np

from velox_core.ops import jl_matrix

__all__ = [
    "estimator_constant",
    "index_bits",
    "outlier_mask",
    "projection",
    "sketch_inner",
    "top_channels",
]


def projection(dim: int, rows: int, seed: int, orthogonal: bool) -> mx.array:
    """The seeded sketch matrix ``S`` (kept in float16: it is resident, so it is counted).

    Shapes:
        returns ``(rows, dim)`` float16; entries ``N(0, 1)`` (``orthogonal=False``) or each
        block of ``dim`` rows orthonormalized and scaled by ``sqrt(dim)``.
    """
    s = np.array(jl_matrix(dim, rows, seed), dtype=np.float64)
    if orthogonal:
        for start in range(0, rows, dim):
            q, r = np.linalg.qr(s[start : start + dim].T)  # (dim, r): orthonormal columns
            q = q * np.where(np.diag(r) >= 0, 1.0, -1.0)[None, :]  # Haar, as random_orthogonal
            s[start : start + dim] = q.T * math.sqrt(dim)
    return mx.array(s.astype(np.float32)).astype(mx.float16)


def estimator_constant(dim: int, orthogonal: bool) -> float:
    """``c`` of the estimator ``c / m * ||k|| * <S q, sign(S k)>`` (unbiased for either S)."""
    if not orthogonal:
        return math.sqrt(math.pi / 2)
    mean_abs = math.exp(math.lgamma(dim / 2) - math.lgamma((dim + 1) / 2)) / math.sqrt(math.pi)
    return 1.0 / (math.sqrt(dim) * mean_abs)


def sketch_inner(q_proj: mx.array, bits: mx.array, norms: mx.array) -> mx.array:
    """Unbiased estimate of ``<q, k>`` from a projected query and a key's sign sketch.

    Shapes:
        q_proj ``(..., M, m)`` = ``q @ S.T``; bits ``(..., T, m)`` codes in {0, 1};
        norms ``(..., T)``; returns float32 ``(..., M, T)``.
    """
    m = q_proj.shape[-1]
    signs = bits.astype(mx.float32) * 2 - 1
    dots = q_proj.astype(mx.float32) @ mx.swapaxes(signs, -1, -2)
    return dots * (math.sqrt(math.pi / 2) / m) * mx.expand_dims(norms.astype(mx.float32), -2)


def index_bits(dim: int) -> int:
    """Bits of one channel index (``ceil(log2 dim)``, at least 1)."""
    return max(1, (dim - 1).bit_length())


def top_channels(x: mx.array, count: int, group: int) -> mx.array:
    """The ``count`` channels of largest energy in each block of ``group`` tokens.

    As the authors' ``QJLKeyQuantizer``: per (batch, head, block), the channels with the largest
    norm over the block's tokens. Sorted ascending.

    Shapes:
        x ``(B, H, T, D)`` float32 with ``T % group == 0``; returns int32
        ``(B, H, T // group, count)``.
    """
    b, h, t, d = x.shape
    energy = mx.sum(mx.square(x.reshape(b, h, t // group, group, d)), axis=3)
    idx = mx.argpartition(-energy, kth=count - 1, axis=-1)[..., :count]
    return mx.sort(idx.astype(mx.int32), axis=-1)


def outlier_mask(idx: mx.array, dim: int, group: int) -> mx.array:
    """Per-token boolean mask of the outlier channels.

    Shapes:
        idx ``(B, H, n, count)``; returns bool ``(B, H, n * group, dim)``.
    """
    b, h, n, _ = idx.shape
    hit = mx.any(mx.arange(dim, dtype=mx.int32) == idx[..., None], axis=-2)  # (B, H, n, D)
    return mx.broadcast_to(hit[:, :, :, None, :], (b, h, n, group, dim)).reshape(
        b, h, n * group, dim
    )
