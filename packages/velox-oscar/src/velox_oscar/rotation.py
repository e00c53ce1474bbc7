"""OSCAR's rotations and its token-wise clip (arXiv 2605.17757).

Keys and values are stored in a rotated basis, ``x -> x R`` (row vectors), with

    R = U . H . P_br

* ``U``: the eigenvectors of an attention-aware covariance of the layer (keys: the query
  covariance ``C_K = Q^T Q``, since a key's error ``e`` moves a logit by ``q . e``, so its mean
  square is ``e^T C_Q e``; values: the score-weighted value covariance
  ``C_S = sum_t w_t v_t v_t^T`` with ``w_t = k_t^T C_Q k_t``, the expected squared logit of the
  token, as the authors' ``compute_kv_rotation.py`` estimates it), as columns in the order
  ``eigh`` gives them (ascending eigenvalues);
* ``H``: the normalized Sylvester Walsh-Hadamard matrix of the head dim, which spreads each
  eigen-direction over every channel so no channel holds an outlier;
* ``P_br``: a bit-reversal permutation of the channels keyed by the eigenvalues: output
  channel ``br(i)`` takes column ``s_i`` of ``U H``, where ``s_i`` is the index of the
  ``i``-th largest eigenvalue and ``br`` reverses the bits of ``i``. Consecutive ranks land
  far apart, so a quantization group of fewer channels than the head dim receives its share
  of every part of the spectrum (with one group per head, the default, it changes nothing:
  the group's range and the clip threshold do not depend on the channels' order).

``R`` is orthogonal, so ``q . k = (q R) . (k R)`` and the attention output
``sum_t p_t v_t = (sum_t p_t v_t R) R^T``: the cache rotates the query once and the mixed
values back once per call, never a stored token.

The clip (the authors' serving kernel): each rotated row (one token of one KV head) is clamped
to ``[-tau, tau]`` with ``tau`` the entry of rank ``int(ratio * D)`` among its sorted absolute
values (``ratio`` 1 keeps the row), before the asymmetric min-max INT2 grid is laid. The
ratio is fitted offline per layer and side (:mod:`velox_oscar.fit`).
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

__all__ = [
    "Rotation",
    "bit_reversal",
    "br_permutation",
    "clip_rank",
    "hadamard_matrix",
    "oscar_rotation",
    "quantile_clip",
]


def hadamard_matrix(d: int) -> np.ndarray:
    """The normalized Sylvester Hadamard matrix (symmetric, orthogonal).

    Shapes: returns float64 ``(d, d)``; ``d`` must be a power of two.
    """
    if d < 1 or d & (d - 1):
        raise ValueError(f"the Walsh-Hadamard factor needs a power-of-two head dim, got {d}")
    h = np.ones((1, 1))
    while h.shape[0] < d:
        h = np.block([[h, h], [h, -h]])
    return h / np.sqrt(d)


def bit_reversal(d: int) -> np.ndarray:
    """``br[i]``: ``i`` with its ``log2(d)`` bits reversed. Shapes: returns int64 ``(d,)``."""
    if d < 1 or d & (d - 1):
        raise ValueError(f"the bit-reversal permutation needs a power-of-two size, got {d}")
    bits = d.bit_length() - 1
    i = np.arange(d)
    out = np.zeros(d, dtype=np.int64)
    for b in range(bits):
        out |= ((i >> b) & 1) << (bits - 1 - b)
    return out


def br_permutation(eigenvalues: np.ndarray) -> np.ndarray:
    """The column order of ``P_br``: ``(U H P)[:, j] = (U H)[:, perm[j]]`` with
    ``perm[br(i)]`` the index of the ``i``-th largest eigenvalue.

    Shapes: eigenvalues ``(D,)``; returns int64 ``(D,)``.
    """
    lam = np.asarray(eigenvalues, dtype=np.float64)
    order = np.argsort(-lam, kind="stable")
    perm = np.empty(lam.size, dtype=np.int64)
    perm[bit_reversal(lam.size)] = order
    return perm


def oscar_rotation(cov: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``R = U H P_br`` of a covariance, and its eigenvalues.

    Shapes: cov ``(D, D)`` (symmetrized here); returns float64 ``R`` ``(D, D)`` (orthogonal)
    and the eigenvalues ``(D,)`` in ``eigh``'s ascending order.
    """
    c = np.asarray(cov, dtype=np.float64)
    lam, u = np.linalg.eigh((c + c.T) / 2)
    uh = u @ hadamard_matrix(c.shape[0])
    return uh[:, br_permutation(lam)], lam


class Rotation:
    """The orthogonal map ``x -> x R`` of a ``(D, D)`` matrix, and its inverse ``y -> y R^T``.

    ``R`` is held as given (the codec's resident state, float16); each call multiplies in
    float32.

    Shapes: ``forward(x)`` and ``inverse(y)`` take ``(..., D)`` and return float32 ``(..., D)``.
    """

    def __init__(self, matrix: mx.array):
        if matrix.ndim != 2 or matrix.shape[0] != matrix.shape[1]:
            raise ValueError(f"a rotation must be a square matrix, got {tuple(matrix.shape)}")
        self.matrix = matrix
        self.dim = int(matrix.shape[0])

    def forward(self, x: mx.array) -> mx.array:
        return x.astype(mx.float32) @ self.matrix.astype(mx.float32)

    def inverse(self, y: mx.array) -> mx.array:
        return y.astype(mx.float32) @ self.matrix.astype(mx.float32).T


def clip_rank(ratio: float, dim: int) -> int:
    """The rank (0-based, ascending) of the clip threshold among a row's ``dim`` absolute
    values: ``int(ratio * dim)``, at most ``dim - 1`` (the row's largest: no clip)."""
    return max(0, min(int(ratio * dim), dim - 1))


def quantile_clip(x: mx.array, ratio: float) -> mx.array:
    """Each row clamped to ``[-tau, tau]``, ``tau`` its :func:`clip_rank`-th smallest
    absolute value.

    Shapes: x ``(..., D)``; returns float32 ``(..., D)``.
    """
    x = x.astype(mx.float32)
    d = x.shape[-1]
    rank = clip_rank(ratio, d)
    if rank == d - 1:  # the row's largest: nothing is clipped
        return x
    tau = mx.partition(mx.abs(x), rank, axis=-1)[..., rank : rank + 1]
    return mx.clip(x, -tau, tau)
