"""Fitting the commutative codebooks by EM, one residual stage at a time.

CommVQ (arXiv 2506.18879, https://arxiv.org/abs/2506.18879, Sec. 3.3) fits its RoPE-commutative
codebook with an EM algorithm, as the authors' ``quantize_key_cache.py`` does: soft
assignments with an annealed temperature (E-step), then the codebook that minimizes the
assignment-weighted squared error *under the commutative structure*, in closed form (M-step);
each stage is fitted on the residuals the previous stages leave.

With responsibilities ``g[n, j, k]`` of vector ``x_n`` for codeword ``a_j + J b_k`` the M-step
minimizes ``sum g ||x_n - a_j - J b_k||**2``. Writing ``b'_k = J b_k``, the normal equations
are one symmetric ``2K x 2K`` system per group, shared by all its coordinates::

    [diag(N 1)   N         ] [a ]   [S 1  ]
    [N^T         diag(N^T 1)] [b'] = [S^T 1]

with ``N[j, k] = sum_n g`` and ``S[j, k] = sum_n g x_n`` (``S 1`` and ``S^T 1`` are sums
weighted by the marginal responsibilities, never the ``K x K`` table); ``a_j + c``, ``b'_k - c``
give the same codewords, so a small ridge picks one solution (the authors invert the same
system, ``T^T N T``, directly). The groups of a stage are independent problems and are fitted
separately.

Deviations from the authors' code, in how the EM is run (not in what it fits): their E-step
takes a softmax of minus the Euclidean distance over the temperature, with absolute
temperatures (``1e-3`` to ``1e-5``, divided by 10 every 4 stages) for vectors normalized over
all KV heads together; here the softmax is of minus the *squared* distance (the Gaussian
mixture's E-step, whose M-step is exactly the least squares above) and temperatures are
relative: ``tau = t * E`` with ``E`` the mean squared norm of the group's residual, ``t`` going
geometrically from ``temperature[0]`` to ``temperature[1]``, so one schedule serves every stage
and head. They run up to 100 iterations on up to ``256 K**2`` vectors per group; the defaults
here run 16 to 30 on a few thousand. The iterate with the lowest hard-assignment error is
kept, per group (theirs: per head). Initialization follows the authors: ``K**2`` random
training vectors as codewords, one soft E-step, one M-step.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from .vq import (
    Geometry,
    decode_pairs,
    distances,
    encode_pairs,
    group_pairs,
    jrot_inv,
    ungroup_codebook,
)

__all__ = ["fit_residual", "fit_stage"]

_RIDGE = 1e-4


def _m_step(x: mx.array, g: mx.array, k: int) -> tuple[mx.array, mx.array]:
    """Closed-form codebooks of one stage.

    Shapes:
        x ``(n, N, C)`` grouped residuals; g ``(n, N, K, K)`` responsibilities of codeword
        ``(j, k)``; returns ``a`` and ``b' = J b``, each ``(n, K, C)``.
    """
    counts = mx.sum(g, axis=1)  # (n, K, K): N[j, k]
    ga, gb = mx.sum(g, axis=3), mx.sum(g, axis=2)  # (n, N, K): marginals over k and over j
    rows, cols = mx.sum(counts, 2), mx.sum(counts, 1)  # (n, K)
    eye = mx.eye(k)[None]
    top = mx.concatenate([rows[:, :, None] * eye, counts], axis=2)
    bottom = mx.concatenate([mx.swapaxes(counts, 1, 2), cols[:, :, None] * eye], axis=2)
    m = mx.concatenate([top, bottom], axis=1)  # (n, 2K, 2K)
    # a_j + c, b'_k - c give the same codewords: a small ridge picks the smallest solution
    ridge = _RIDGE * mx.mean(mx.concatenate([rows, cols], 1), axis=1) + 1e-12
    m = m + ridge[:, None, None] * mx.eye(2 * k)[None]
    # right-hand sides: S 1 = sum_n (sum_k g[n, j, k]) x_n and S^T 1 likewise
    rhs = mx.concatenate([mx.swapaxes(ga, 1, 2) @ x, mx.swapaxes(gb, 1, 2) @ x], axis=1)
    sol = mx.linalg.solve(m, rhs, stream=mx.cpu)  # (n, 2K, C)
    return sol[:, :k], sol[:, k:]


def _soft(d: mx.array, tau: float) -> mx.array:
    shape = d.shape
    return mx.softmax(-d.reshape(*shape[:-2], -1) / tau, axis=-1).reshape(shape)


def _fit_groups(
    xg: mx.array, k: int, iters: int, temperature: tuple[float, float], rng: np.random.Generator
) -> tuple[mx.array, mx.array, mx.array]:
    """EM for independent groups, each its own problem (own temperature scale and best iterate).

    Shapes:
        xg ``(n, N, C)`` grouped residuals; returns ``a``, ``b' = J b`` ``(n, K, C)`` and each
        group's squared error summed over the ``N`` vectors ``(n,)``, of the best iterate.
    """
    big = xg.shape[1]
    norms = mx.sum(xg * xg, axis=-1)  # (n, N)
    energy = mx.maximum(mx.mean(norms, axis=1), 1e-12)[:, None, None]  # (n, 1, 1)
    t0, t1 = temperature
    # the authors' initialization: K**2 training vectors as codewords, one soft E-step, M-step
    pick = mx.array(rng.choice(big, size=k * k, replace=big < k * k).astype(np.int32))
    c0 = xg[:, pick]  # (n, K*K, C)
    d0 = mx.sum(c0 * c0, -1)[:, None] - 2 * (xg @ mx.swapaxes(c0, 1, 2))
    g = mx.softmax(-d0 / (t0 * energy), axis=-1).reshape(*d0.shape[:2], k, k)
    a, bp = _m_step(xg, g, k)
    best_a, best_b, best_err = a, bp, mx.full((xg.shape[0],), mx.inf)
    for it in range(iters + 1):
        d = distances(xg[None, None], a[None], bp[None])[0, 0]  # (n, N, K, K)
        err = mx.sum(mx.min(d.reshape(*d.shape[:2], -1), -1) + norms, axis=1)  # (n,) hard
        better = err < best_err
        best_a = mx.where(better[:, None, None], a, best_a)
        best_b = mx.where(better[:, None, None], bp, best_b)
        best_err = mx.minimum(err, best_err)
        if it == iters:
            break
        tau = t0 * (t1 / t0) ** (it / max(iters - 1, 1)) * energy  # annealed, per group
        a, bp = _m_step(xg, _soft(d, tau), k)
        mx.eval(a, bp, best_a, best_b, best_err)
    mx.eval(best_a, best_b, best_err)
    return best_a, best_b, best_err


def fit_stage(
    x: mx.array,
    entries: int,
    pairs: int,
    iters: int = 30,
    temperature: tuple[float, float] = (0.3, 3e-3),
    rng: np.random.Generator | None = None,
    chunk: int = 2,
) -> tuple[mx.array, mx.array, float]:
    """Fit one stage's two codebooks to residual pairs.

    The ``P/G`` groups are independent problems (each has its own codebooks and codes); they
    are fitted ``chunk`` at a time, which keeps the ``(chunk, N, K, K)`` responsibilities small.

    Args:
        x: residual channel pairs ``(N, P, 2)`` float32.
        entries: ``K``, entries of each codebook.
        pairs: ``G``, pairs per code.
        iters: EM iterations after the initialization.
        temperature: relative start and end temperatures of the soft E-step.
        rng: source of the initial codewords.
        chunk: groups fitted together.

    Returns:
        ``(a, b, error)``: codebooks ``(P, K, 2)`` float32 (codeword ``a[c1] + J b[c2]``) and
        the mean squared error per vector of their hard assignment.
    """
    rng = rng or np.random.default_rng(0)
    xg = group_pairs(x[None, None].astype(mx.float32), pairs)[0, 0]  # (n, N, C)
    parts = [
        _fit_groups(xg[i : i + chunk], entries, iters, temperature, rng)
        for i in range(0, xg.shape[0], chunk)
    ]
    a = mx.concatenate([p[0] for p in parts])
    bp = mx.concatenate([p[1] for p in parts])
    err = float(mx.sum(mx.concatenate([p[2] for p in parts])).item()) / xg.shape[1]
    a, bp = (ungroup_codebook(c[None])[0] for c in (a, bp))
    return a, jrot_inv(bp), err


def fit_residual(
    x: mx.array,
    geometry: Geometry,
    iters: int = 30,
    temperature: tuple[float, float] = (0.3, 3e-3),
    seed: int = 0,
) -> tuple[mx.array, mx.array, list[float]]:
    """Fit every stage of one head's residual quantizer.

    Args:
        x: normalized pre-RoPE channel pairs ``(N, P, 2)``.
        geometry: pairs per code, codebook entries and stages.
        iters, temperature: see :func:`fit_stage`.
        seed: seed of the initial codewords.

    Returns:
        ``(a, b, errors)``: ``(S, P, K, 2)`` float32 codebooks and each stage's mean squared
        residual per vector.
    """
    rng = np.random.default_rng(seed)
    r = x.astype(mx.float32)
    books_a, books_b, errors = [], [], []
    for _ in range(geometry.stages):
        a, b, err = fit_stage(r, geometry.entries, geometry.pairs, iters, temperature, rng)
        codes = encode_pairs(r[None, None], a[None, None], b[None, None], geometry.pairs)
        r = r - decode_pairs(codes, a[None, None], b[None, None], geometry.pairs)[0, 0]
        mx.eval(r)
        books_a.append(a)
        books_b.append(b)
        errors.append(err)
    return mx.stack(books_a), mx.stack(books_b), errors
