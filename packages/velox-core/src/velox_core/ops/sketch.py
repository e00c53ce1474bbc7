"""Johnson-Lindenstrauss sign sketches (arXiv 2406.03482).

A key ``k`` is stored as ``sign(S k)`` (``m`` bits) and ``||k||``; for a query ``q`` the
estimator ``sqrt(pi/2) / m * ||k|| * <S q, sign(S k)>`` is unbiased for ``<q, k>`` when the
rows of ``S`` are i.i.d. ``N(0, I)`` (arXiv 2406.03482, Lemma 3.2), with variance ``O(1/m)``.
The estimator itself lives in the method package that scores keys by it, its only user;
the projection and the sign bits are here, shared by every method that sketches keys or
their residuals.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from ..validation import check_int

__all__: list[str] = []


def jl_matrix(dim: int, m: int, seed: int = 0) -> mx.array:
    """Seeded Gaussian projection ``S`` with i.i.d. ``N(0, 1)`` entries.

    Shapes:
        returns ``(m, dim)`` float32.
    """
    check_int("dim", dim, minimum=1)
    check_int("m", m, minimum=1)
    check_int("seed", seed, minimum=0)
    rng = np.random.default_rng(seed)
    return mx.array(rng.standard_normal((m, dim)).astype(np.float32))


def sign_sketch(x: mx.array, s: mx.array) -> mx.array:
    """Sign bits of ``S x`` as codes in {0, 1} (1 where ``S x >= 0``).

    Shapes:
        x ``(..., dim)``, s ``(m, dim)``; returns uint8 ``(..., m)``.
    """
    return (x.astype(mx.float32) @ s.T >= 0).astype(mx.uint8)
