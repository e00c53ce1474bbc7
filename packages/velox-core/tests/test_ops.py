"""Primitives checked against mathematics, not against themselves."""

import importlib
import math

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from velox_core.ops import (
    RandomizedHadamard,
    affine_dequantize,
    affine_quantize,
    block_size,
    byte_table,
    hadamard,
    jl_matrix,
    kmeans,
    lookup,
    pack,
    packed_words,
    random_orthogonal,
    sign_sketch,
    unpack,
)
from velox_core.ops.hadamard import fwht
from velox_core.ops.lloyd_max import lloyd_max_gaussian
from velox_core.ops.pca import pca, principal_axes


def sylvester(n):
    h = np.array([[1.0]])
    while h.shape[0] < n:
        h = np.block([[h, h], [h, -h]])
    return h / math.sqrt(n)


@pytest.mark.parametrize("n", [2, 8, 64, 128, 256])
def test_fwht_is_the_hadamard_matrix(n):
    x = np.random.default_rng(0).standard_normal((5, n)).astype(np.float32)
    want = x @ sylvester(n).T
    assert np.allclose(np.array(fwht(mx.array(x))), want, atol=1e-4)
    assert np.allclose(np.array(hadamard(mx.array(x))), want, atol=1e-4)


@pytest.mark.parametrize("dim", [64, 80, 96, 112, 128])
def test_randomized_hadamard_orthogonal_and_invertible(dim):
    r = RandomizedHadamard(dim, seed=3)
    m = np.array(r.matrix())
    assert np.allclose(m @ m.T, np.eye(dim), atol=1e-5)
    x = mx.random.normal((3, 7, dim))
    assert mx.allclose(r.inverse(r.forward(x)), x, atol=1e-5).item()
    # norms are preserved
    assert mx.allclose(
        mx.linalg.norm(r.forward(x), axis=-1), mx.linalg.norm(x, axis=-1), rtol=1e-5
    ).item()


def test_block_sizes_for_odd_head_dims():
    assert [block_size(d) for d in (80, 96, 112, 128)] == [16, 32, 16, 128]


def test_hadamard_spreads_an_outlier():
    x = mx.zeros((1, 128)).at[0, 5].add(10.0)
    y = RandomizedHadamard(128, seed=0).forward(x)
    assert float(mx.max(mx.abs(y)).item()) == pytest.approx(10 / math.sqrt(128), rel=1e-4)


def test_fwht_rejects_non_power_of_two():
    with pytest.raises(ValueError):
        fwht(mx.zeros((3, 96)))


def test_random_orthogonal():
    q = np.array(random_orthogonal(96, seed=1))
    assert np.allclose(q @ q.T, np.eye(96), atol=1e-5)
    assert np.array_equal(q, np.array(random_orthogonal(96, seed=1)))
    assert not np.allclose(q, np.array(random_orthogonal(96, seed=2)))


# Known optimum MSE of the Lloyd-Max quantizer for N(0, 1) (Max 1960; Jayant & Noll)
@pytest.mark.parametrize("bits,mse", [(1, 0.3634), (2, 0.1175), (3, 0.03454), (4, 0.009497)])
def test_lloyd_max_gaussian_matches_known_optimum(bits, mse):
    cb = lloyd_max_gaussian(bits)
    assert cb.mse == pytest.approx(mse, rel=0.01)
    # the same figure measured on samples
    x = mx.array(np.random.default_rng(bits).standard_normal(400_000).astype(np.float32))
    err = float(mx.mean((cb.decode(cb.encode(x)) - x) ** 2).item())
    assert err == pytest.approx(mse, rel=0.02)


def test_lloyd_max_gaussian_one_bit_is_closed_form():
    c = lloyd_max_gaussian(1).centroids
    assert np.allclose(c, [-math.sqrt(2 / math.pi), math.sqrt(2 / math.pi)], atol=1e-4)


@pytest.mark.parametrize("bits", range(1, 9))
def test_codebooks_sorted_and_symmetric(bits):
    cb = lloyd_max_gaussian(bits)
    assert len(cb.centroids) == 2**bits
    assert np.all(np.diff(cb.centroids) > 0)
    assert np.allclose(cb.centroids, -cb.centroids[::-1], atol=1e-5)


@settings(max_examples=60, deadline=None)
@given(
    bits=st.integers(1, 8),
    n=st.integers(1, 300),
    rows=st.integers(1, 3),
    seed=st.integers(0, 10**6),
)
def test_pack_round_trip(bits, n, rows, seed):
    codes = np.random.default_rng(seed).integers(0, 2**bits, size=(rows, n)).astype(np.uint8)
    words = pack(mx.array(codes), bits)
    assert words.dtype == mx.uint32 and words.shape == (rows, packed_words(n, bits))
    assert np.array_equal(np.array(unpack(words, bits, n)), codes)


@pytest.mark.parametrize("bits", [2, 3, 4, 5, 6, 8])
def test_pack_layout_matches_mlx_quantize(bits):
    x = mx.random.normal((4, 128))
    wq, s, z = mx.quantize(x, group_size=64, bits=bits)
    deq = mx.dequantize(wq, s, z, group_size=64, bits=bits)
    codes = mx.round((deq - mx.repeat(z, 64, axis=-1)) / mx.repeat(s, 64, axis=-1)).astype(mx.uint8)
    assert mx.array_equal(pack(codes, bits), wq)


@settings(max_examples=40, deadline=None)
@given(bits=st.sampled_from([1, 2, 4, 8]), n=st.integers(1, 300), seed=st.integers(0, 10**6))
def test_lookup_reads_the_codes_a_byte_at_a_time(bits, n, seed):
    rng = np.random.default_rng(seed)
    codes = rng.integers(0, 2**bits, size=(2, 3, n)).astype(np.uint8)
    values = mx.array(rng.normal(size=2**bits).astype(np.float32))
    got = lookup(pack(mx.array(codes), bits), bits, n, byte_table(values, bits))
    assert got.shape == (2, 3, n) and got.dtype == mx.float32
    assert np.array_equal(np.array(got), np.array(values)[codes])


def test_lookup_bad_input():
    words = pack(mx.zeros((2, 32), dtype=mx.uint8), 4)
    with pytest.raises(ValueError, match="bits must be one of"):
        byte_table(mx.zeros((8,)), 3)
    with pytest.raises(ValueError, match=r"values must be \(16,\)"):
        byte_table(mx.zeros((8,)), 4)
    with pytest.raises(ValueError, match="table"):
        lookup(words, 4, 32, mx.zeros((256, 4)))
    with pytest.raises(ValueError, match="uint32 words"):
        lookup(words, 4, 40, byte_table(mx.zeros((16,)), 4))


def test_pack_bad_input():
    with pytest.raises(ValueError):
        pack(mx.zeros((2, 4), dtype=mx.uint8), 9)
    with pytest.raises(ValueError):
        unpack(mx.zeros((2, 3), dtype=mx.uint32), 4, 32)
    with pytest.raises(TypeError):
        unpack(mx.zeros((2, 4), dtype=mx.int32), 4, 32)


@pytest.mark.parametrize("axis", ["token", "channel"])
@pytest.mark.parametrize("bits", [2, 4, 8])
def test_affine_error_within_half_step(axis, bits):
    x = mx.random.normal((2, 3, 64, 128), key=mx.random.key(bits))
    codes, s, z = affine_quantize(x, bits, 32, axis)
    xd = affine_dequantize(codes, s, z, 32, axis)
    step = mx.repeat(s.astype(mx.float32), 32, axis=-1 if axis == "token" else -2)
    assert bool(mx.all(mx.abs(xd - x) <= step * 0.5 + 2e-3 * mx.abs(x) + 1e-3).item())
    assert int(mx.max(codes).item()) <= 2**bits - 1


def test_affine_clip_shrinks_range():
    x = mx.random.normal((1, 1, 8, 64))
    _, s1, _ = affine_quantize(x, 4, 64, "token", clip=1.0)
    _, s2, _ = affine_quantize(x, 4, 64, "token", clip=0.5)
    assert mx.allclose(s2.astype(mx.float32), 0.5 * s1.astype(mx.float32), rtol=1e-2).item()


def test_affine_bad_group():
    with pytest.raises(ValueError, match="group"):
        affine_quantize(mx.zeros((1, 1, 4, 80)), 4, 64, "token")
    with pytest.raises(ValueError, match="axis"):
        affine_quantize(mx.zeros((1, 1, 4, 64)), 4, 64, "rows")


def test_jl_matrix_is_a_seeded_gaussian_and_sign_sketch_marks_nonnegative_projections():
    """``jl_matrix``: ``(m, dim)`` float32, the same for a seed, another for another seed,
    entries of mean 0 and variance 1; ``sign_sketch``: 1 exactly where ``S x >= 0``."""
    s = jl_matrix(64, 256, seed=3)
    assert s.shape == (256, 64) and s.dtype == mx.float32
    a = np.array(s)
    np.testing.assert_array_equal(a, np.array(jl_matrix(64, 256, seed=3)))
    assert not np.array_equal(a, np.array(jl_matrix(64, 256, seed=4)))
    assert abs(a.mean()) < 0.03 and abs(a.std() - 1) < 0.03  # 16,384 draws
    x = np.random.default_rng(0).standard_normal((5, 64)).astype(np.float32)
    bits = sign_sketch(mx.array(x), s)
    assert bits.dtype == mx.uint8 and bits.shape == (5, 256)
    np.testing.assert_array_equal(np.array(bits), (x @ a.T >= 0).astype(np.uint8))
    with pytest.raises(ValueError, match="m must be >= 1, got 0"):
        jl_matrix(64, 0)


def test_kmeans_finds_separated_clusters():
    rng = np.random.default_rng(0)
    centers = np.array([[0, 0], [10, 0], [0, 10]], dtype=np.float32)
    x = np.concatenate([c + rng.normal(0, 0.1, size=(50, 2)) for c in centers]).astype(np.float32)
    c, a = kmeans(mx.array(x), 3, iters=10, seed=0)
    found = np.array(c)
    for center in centers:
        assert np.min(np.linalg.norm(found - center, axis=1)) < 0.2
    assert len(set(np.array(a).tolist())) == 3


def _kmeanspp_reference(x, k, seed):
    """k-means++ seeding, one group after another, in the plainest numpy."""
    g, n, _ = x.shape
    rng = np.random.default_rng(seed)
    out = np.empty((g, k, x.shape[-1]), dtype=np.float32)
    for i in range(g):
        pts = x[i]
        c = [pts[rng.integers(n)]]
        d2 = np.sum((pts - c[0]) ** 2, axis=-1)
        for _ in range(1, k):
            p = d2 / d2.sum() if d2.sum() > 0 else np.full(n, 1.0 / n)
            c.append(pts[rng.choice(n, p=p)])
            d2 = np.minimum(d2, np.sum((pts - c[-1]) ** 2, axis=-1))
        out[i] = np.stack(c)
    return out


def _lloyd_reference(x, c, iters):
    """Lloyd steps in float64 numpy: each vector to its nearest centroid, each centroid to the
    mean of its vectors; a centroid with no vectors stays where it is."""
    x = x.astype(np.float64)
    c = c.astype(np.float64)

    def nearest(c):
        return np.argmin(np.sum((x[:, :, None, :] - c[:, None, :, :]) ** 2, axis=-1), axis=-1)

    a = nearest(c)
    for _ in range(iters):
        c = c.copy()
        for i in range(x.shape[0]):
            for j in range(c.shape[1]):
                members = x[i][a[i] == j]
                if len(members):
                    c[i, j] = members.mean(axis=0)
        a = nearest(c)
    return c, a


@pytest.mark.parametrize(
    ("g", "n", "d", "k", "duplicates"),
    [(3, 300, 2, 16, False), (2, 500, 8, 40, False), (2, 200, 9, 7, False), (2, 60, 3, 9, True)],
)
def test_kmeans_seeding_is_kmeanspp_of_each_group_in_turn(g, n, d, k, duplicates):
    rng = np.random.default_rng(n + d)
    if duplicates:  # four distinct vectors: the last seeds are drawn uniformly (all d2 are 0)
        x = rng.normal(size=(g, 4, d))[:, rng.integers(0, 4, size=n)]
    else:
        x = rng.normal(size=(g, n, d)) * rng.choice([1e-3, 1.0, 1e3], size=(g, n, 1))
    x = x.astype(np.float32)
    c, a = kmeans(mx.array(x), k, iters=0, seed=11)
    np.testing.assert_array_equal(np.array(c), _kmeanspp_reference(x, k, 11))
    assert c.dtype == mx.float32 and a.dtype == mx.uint32 and a.shape == (g, n)
    one, _ = kmeans(mx.array(x[1]), k, iters=0, seed=11)
    np.testing.assert_array_equal(np.array(one), _kmeanspp_reference(x[1:2], k, 11)[0])


@pytest.mark.parametrize("path", ["numpy", "mlx"])
@pytest.mark.parametrize("iters", [1, 4])
def test_kmeans_lloyd_steps_match_a_numpy_reference(path, iters):
    km = importlib.import_module("velox_core.ops.kmeans")
    rng = np.random.default_rng(3)
    x = rng.normal(size=(3, 300, 3)).astype(np.float32)
    c0 = x[:, :7].copy()
    c0[:, 6] = 50.0  # nearest to no vector: an empty cluster, which keeps its centroid
    if path == "numpy":
        c, a = km._lloyd_numpy(x, c0, iters)
    else:
        c, a = km._lloyd_mlx(mx.array(x), mx.array(c0), iters)
        assert c.dtype == mx.float32 and a.dtype == mx.uint32
        c, a = np.array(c), np.array(a)
    ref_c, ref_a = _lloyd_reference(x, c0, iters)
    assert c.dtype == np.float32 and c.shape == (3, 7, 3) and a.shape == (3, 300)
    np.testing.assert_array_equal(a, ref_a)
    np.testing.assert_allclose(c, ref_c, rtol=1e-5, atol=1e-6)
    assert np.all(c[:, 6] == 50.0)
    assert np.all(np.bincount(a.reshape(-1) % 7, minlength=7)[:6] > 0)


def test_kmeans_is_its_seeding_then_lloyd_steps():
    """The public path (numpy steps on the CPU), with empty clusters: duplicated seeds."""
    rng = np.random.default_rng(5)
    x = rng.normal(size=(2, 5, 2))[:, rng.integers(0, 5, size=80)].astype(np.float32)
    seeds, _ = kmeans(mx.array(x), 8, iters=0, seed=2)
    c, a = kmeans(mx.array(x), 8, iters=3, seed=2)
    ref_c, ref_a = _lloyd_reference(x, np.array(seeds), 3)
    assert len(np.unique(np.array(seeds)[0], axis=0)) < 8  # some cluster is empty
    np.testing.assert_array_equal(np.array(a), ref_a)
    np.testing.assert_allclose(np.array(c), ref_c, rtol=1e-5, atol=1e-6)


# -- RoPE ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("traditional", [False, True])
@pytest.mark.parametrize("dims", [64, 32])
def test_rope_rotate_matches_mlx_fast_rope(traditional, dims):
    from velox_core.ops.rope import RopeSpec, rotate

    x = mx.random.normal((1, 2, 7, 64), key=mx.random.key(3))
    spec = RopeSpec.from_base(10000.0, dims, traditional)
    ref = mx.fast.rope(x, dims, traditional=traditional, base=10000.0, scale=1.0, offset=5)
    np.testing.assert_allclose(np.array(rotate(x, 5, spec)), np.array(ref), atol=2e-5)
    pos = mx.arange(5, 12)[None, None]  # the same positions as an array
    np.testing.assert_allclose(np.array(rotate(x, pos, spec)), np.array(ref), atol=2e-5)
    back = rotate(rotate(x, 5, spec), 5, spec, inverse=True)
    np.testing.assert_allclose(np.array(back), np.array(x), atol=2e-5)


def test_rope_spec_reads_modules_and_refuses_others():
    import mlx.nn as nn
    from mlx_lm.models.rope_utils import DynamicNTKScalingRoPE

    from velox_core.ops.rope import find_rope, rope_spec
    from velox_testing import tiny_model

    spec = rope_spec(nn.RoPE(32, traditional=True, base=500.0))
    assert spec.layout == [32, 1] and np.isclose(spec.theta[1], 500.0 ** (-2 / 32))
    with pytest.raises(TypeError, match="mymethod: unsupported RoPE class .*base with the seq"):
        rope_spec(DynamicNTKScalingRoPE(32, 4096, False, 10000.0, 2.0), "mymethod")
    model = tiny_model("llama")
    assert isinstance(find_rope(model, 0), nn.RoPE)
    with pytest.raises(ValueError, match="mymethod: the model has no layer 99"):
        find_rope(model, 99, "mymethod")


def test_fast_rotate_matches_rotate_with_an_offset_per_row():
    from velox_core.ops.rope import RopeSpec, fast_rotate, rotate

    x = mx.random.normal((2, 2, 5, 64), key=mx.random.key(4))
    spec = RopeSpec.from_base(10000.0, 48, False)
    off = mx.array([3, 11], mx.int32)
    got = fast_rotate(x, off, spec)
    for i, o in enumerate((3, 11)):
        np.testing.assert_allclose(
            np.array(got[i]), np.array(rotate(x[i : i + 1], o, spec)[0]), atol=3e-5
        )
    back = fast_rotate(got, off, spec, inverse=True)
    np.testing.assert_allclose(np.array(back), np.array(x), atol=3e-5)


def test_principal_axes_are_the_sorted_sign_fixed_eigendecomposition():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(3, 200, 16)) * np.linspace(0.1, 2.0, 16)
    gram = np.swapaxes(x, -1, -2) @ x
    lam, vec = principal_axes(gram)
    assert lam.shape == (3, 16) and vec.shape == (3, 16, 16)
    assert np.all(np.diff(lam, axis=-1) <= 0) and np.all(lam >= 0)  # largest first
    np.testing.assert_allclose(vec @ (lam[..., None] * np.swapaxes(vec, -1, -2)), gram, atol=1e-9)
    lead = np.take_along_axis(vec, np.abs(vec).argmax(axis=-2)[..., None, :], axis=-2)
    assert np.all(lead > 0)  # each column's entry of largest magnitude
    one_lam, one_vec = principal_axes(gram[1])  # one matrix as one of a batch
    assert np.array_equal(one_lam, lam[1]) and np.array_equal(one_vec, vec[1])
    # a rank-1 matrix: one eigenvalue, the rest rounding (none negative)
    lam, _ = principal_axes(np.outer(np.arange(1.0, 9.0), np.arange(1.0, 9.0)))
    assert lam[0] == pytest.approx(204.0) and np.all(lam[1:] >= 0) and lam[1:].max() < 1e-12


def test_pca_is_the_covariance_of_the_rows():
    rng = np.random.default_rng(1)
    x = rng.normal(size=(500, 8)) + np.arange(8)
    mean, lam, vec = pca(x.sum(0), x.T @ x, 500)
    np.testing.assert_allclose(mean, x.mean(0), atol=1e-12)
    want = np.cov(x.T, bias=True)
    np.testing.assert_allclose(vec @ np.diag(lam) @ vec.T, want, atol=1e-9)
