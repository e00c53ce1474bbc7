"""The estimator's mathematics: unbiasedness (Theorem 3.2, Equation 13 of arXiv 2405.12497),
the error bound at the paper's eps0 = 1.9 (Equation 14), and the code search (arXiv
2409.09913, Section 3.2.2) against brute force."""

import itertools
import math

import mlx.core as mx
import numpy as np
import pytest

from velox_rabitq import EPS0, RaBitQ, quantize
from velox_rabitq.quantizer import grid
from velox_testing import kv_data

D = 128


def _tail(a: np.ndarray, d: int = D) -> np.ndarray:
    """``P(|u| > a)`` for ``u`` one coordinate of a uniform point of the sphere S^(d-2).

    For a Haar rotation (or rotation-invariant keys) the part of ``o_bar`` orthogonal to ``o``
    is uniform on that sphere with radius ``sqrt(1 - <o_bar, o>^2)``, so the estimator's error
    leaves the bound exactly when ``|u| sqrt(1 - <o, q>^2) > eps0 / sqrt(d - 1)``."""
    u = np.linspace(0.0, 1.0, 200_001)
    dens = (1 - u * u) ** ((d - 4) / 2)
    cdf = np.concatenate([[0.0], np.cumsum((dens[1:] + dens[:-1]) / 2)])
    return 1 - np.interp(np.minimum(a, 1.0), u, cdf / cdf[-1])


def _pairs(n: int, seed: int, corr: float):
    """``n`` Gaussian keys, each with its own query ``corr * k / ||k|| + noise``, one pair per
    head so that scores are the pairs' own. Shapes: keys and queries ``(1, n, 1, D)``."""
    rng = np.random.default_rng(seed)
    k = rng.normal(size=(1, n, 1, D)) * rng.uniform(0.5, 3.0, size=(1, n, 1, 1))
    u = k / np.linalg.norm(k, axis=-1, keepdims=True)
    q = corr * u + rng.normal(size=(1, n, 1, D)) / math.sqrt(D)
    return mx.array(k.astype(np.float32)), mx.array(q.astype(np.float32))


def _run(bits: int, k: mx.array, q: mx.array, seed: int = 0):
    """Estimates, true inner products and the codec's bound, each ``(n,)``."""
    codec = RaBitQ(bits=bits, centroid=0, seed=seed)
    codec.check(D, mx.float32)
    packed = codec.encode(k)
    est = np.array(codec.scores(q, packed)).reshape(-1)
    bound = np.array(codec.bound(q, packed)).reshape(-1)
    true = np.array(mx.sum(q * k, axis=-1)).reshape(-1)
    ip = np.array(packed.data["ip"].astype(mx.float32)).reshape(-1)
    return est, true, bound, ip


@pytest.mark.parametrize("bits", [1, 2, 3, 4])
def test_error_stays_inside_the_bound_at_the_stated_rate(bits):
    """Equation 14 with eps0 = 1.9: the share of pairs outside the bound is the exact tail of
    the error's law (about 5.6% at D = 128 for orthogonal pairs, 2 (1 - Phi(1.9)) = 5.7% as
    D grows), within binomial noise, and never above the Gaussian rate."""
    n = 6000
    k, q = _pairs(n, seed=bits, corr=0.0)
    est, true, bound, _ = _run(bits, k, q)
    outside = np.mean(np.abs(est - true) > bound)
    kn = np.linalg.norm(np.array(k), axis=-1).reshape(-1)
    qn = np.linalg.norm(np.array(q), axis=-1).reshape(-1)
    rho = true / (kn * qn)
    rate = np.mean(_tail(EPS0 / math.sqrt(D - 1) / np.sqrt(1 - rho**2)))
    sigma = math.sqrt(rate * (1 - rate) / n)
    assert abs(outside - rate) < 4 * sigma, (outside, rate)
    assert outside < 2 * (1 - 0.5 * (1 + math.erf(EPS0 / math.sqrt(2)))) + 4 * sigma
    # the bound is not vacuous: a bound half as wide fails for many more pairs
    assert np.mean(np.abs(est - true) > bound / 2) > 5 * rate


@pytest.mark.parametrize("bits", [1, 2, 3, 4])
def test_estimator_is_unbiased_and_the_plain_one_is_not(bits):
    """Theorem 3.2: E[<o_bar, q> / <o_bar, o>] = <o, q>. With queries correlated to the keys
    (<o, q> about 0.57) the mean error is 0 within 4 standard errors, while the plain
    ``<o_bar, q>`` (the estimate times <o_bar, o>) is biased by ``-(1 - <o_bar, o>) <o, q>``,
    which the same test detects."""
    k, q = _pairs(8000, seed=10 + bits, corr=0.7)
    est, true, _, ip = _run(bits, k, q)
    scale = np.linalg.norm(np.array(k), axis=-1).reshape(-1) * np.linalg.norm(
        np.array(q), axis=-1
    ).reshape(-1)
    err = (est - true) / scale
    se = err.std() / math.sqrt(err.size)
    assert abs(err.mean()) < 4 * se, (err.mean(), se)
    plain = (est * ip - true) / scale
    assert plain.mean() < -10 * se, (plain.mean(), se)
    # its spread is the law's: sqrt((1 - <o, q>^2) (1 - ip^2) / ip^2 / (D - 1))
    rho = true / scale
    want = math.sqrt(np.mean((1 - rho**2) * (1 - ip**2) / ip**2) / (D - 1))
    assert 0.9 < err.std() / want < 1.1, (err.std(), want)


def _z_over_seeds(bits: int, rounds: int, seeds: int = 300) -> np.ndarray:
    """z-scores of the mean estimate over rotation seeds against the true scores, for fixed
    keys with outlier channels and a shared mean (kv_data). Shapes: returns ``(2, 16)``."""
    k, _ = kv_data(t=16, h=1, seed=2)
    k = k.astype(mx.float32)
    q = mx.random.normal((1, 1, 2, D), key=mx.random.key(3)) + k[:, :, :2] / 4
    true = np.array(q @ mx.swapaxes(k, -1, -2))[0, 0]
    est = []
    for s in range(seeds):
        c = RaBitQ(bits=bits, centroid=0, rounds=rounds, seed=s)
        c.check(D, mx.float32)
        est.append(np.array(c.scores(q, c.encode(k)))[0, 0])
    est = np.stack(est)
    return (est.mean(0) - true) / (est.std(0) / math.sqrt(len(est)))


@pytest.mark.parametrize("bits", [1, 4])
def test_unbiased_over_rotations_for_structured_keys(bits):
    """Theorem 3.2's expectation is over the rotation: for fixed structured keys the estimate
    averaged over seeds approaches the true score with the default two Hadamard rounds."""
    z = _z_over_seeds(bits, rounds=2)
    assert np.abs(z).max() < 4.5 and abs(np.median(z)) < 1.0, z


def test_one_hadamard_round_is_biased_for_structured_keys():
    """Why two rounds: one randomized Hadamard round is far from a Haar rotation for keys
    whose energy sits on a few channels, and the 1-bit estimate is then biased."""
    assert np.abs(_z_over_seeds(1, rounds=1)).max() > 10


@pytest.mark.parametrize("bits", [1, 2, 3])
def test_code_search_is_the_exact_maximizer(bits):
    """The code is the grid point of largest cosine with the vector (brute force at D = 4)."""
    rng = np.random.default_rng(bits)
    o = rng.normal(size=(40, 4)).astype(np.float32)
    codes, ip = quantize(mx.array(o), bits)
    levels = np.arange(2**bits) - (2**bits - 1) / 2
    cands = np.array(list(itertools.product(levels, repeat=4)))
    cands = cands / np.linalg.norm(cands, axis=-1, keepdims=True)
    best = np.max((o / np.linalg.norm(o, axis=-1, keepdims=True)) @ cands.T, axis=-1)
    assert np.allclose(np.array(ip), best, atol=1e-5)
    y = np.array(grid(codes, bits))
    got = np.sum(y * o, -1) / (np.linalg.norm(y, axis=-1) * np.linalg.norm(o, axis=-1))
    assert np.allclose(got, best, atol=1e-5)
    assert np.all((np.array(codes) >= 2 ** (bits - 1)) == (o >= 0))  # the top bit is the sign


def test_one_bit_correction_factor_has_the_papers_mean():
    """Footnote 5 of arXiv 2405.12497: E<o_bar, o> = sqrt(D / pi) 2 Gamma(D/2) /
    ((D - 1) Gamma((D - 1) / 2)), about 0.798 at D = 128; and more bits raise it."""
    o = mx.random.normal((4000, D), key=mx.random.key(0))
    means = [float(mx.mean(quantize(o, b)[1]).item()) for b in (1, 2, 3, 4)]
    lg = math.lgamma(D / 2) - math.lgamma((D - 1) / 2)
    want = math.sqrt(D / math.pi) * 2 * math.exp(lg) / (D - 1)
    assert abs(means[0] - want) < 1e-3, (means[0], want)
    assert means == sorted(means) and means[3] > 0.99
