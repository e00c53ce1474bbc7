"""NSNQuant: the conformance suite, and what is NSNQuant's own (the transform, the universal
codebooks, the codes, their bytes and settings)."""

import mlx.core as mx
import numpy as np
import pytest

from velox_core import make, make_cache
from velox_core.ops.lloyd_max import lloyd_max_gaussian
from velox_nsnquant import NSNQuantCache, NSNQuantCodec, codebook, nsn, subvector, train
from velox_nsnquant import codec as ncodec
from velox_nsnquant.transform import Rotation
from velox_testing import (
    CacheConformance,
    assert_exact_ends,
    assert_reloads_alike,
    assert_tampered_state_refused,
    conformance_model,
    kv_data,
    rel_error,
)
from velox_testing.kv import assert_codes_head_dims, assert_scores_and_mix_decoded
from velox_testing.refusals import int_refusals, spec_refusals_test


class TestNSNQuant2Bit(CacheConformance):
    spec = "nsnquant:bits=2"
    precise_spec = "nsnquant:bits=8"

    # 2 + 0.375 bits an entry (two fp16 scales a token, a 128-channel fp16 shift a 128-token
    # block), 0 to 127 fp16 tokens of the block being filled: measured 0.148 at 2,048 tokens
    max_memory_ratio = 0.155
    # measured 0.41; on the same data and query turboquant:bits=2 measures 0.65 and
    # uniform:bits=2 2.03
    attention_error = 0.5
    same_greedy_tokens = 32

    bad_settings = int_refusals(
        group=(1, None), seed=(0, None), bits=(1, 8), value_bits=(1, 8), window=(0, None)
    )


class TestNSNQuant1BitSmallBlocks(CacheConformance):
    """One-bit codes (8-channel sub-vectors) in blocks of 64 tokens, 4 sinks, a 32-token window
    and a seeded rotation kept in the codecs' state."""

    spec = "nsnquant:bits=1,group=64,window=32,sinks=4,seed=3"
    precise_spec = "nsnquant:bits=8,group=64,window=32,sinks=4,seed=3"

    # 1 + 0.5 bits an entry (64-token blocks), 4 sinks and 32 to 95 fp16 tokens: measured 0.125
    max_memory_ratio = 0.13
    # one bit an entry: measured 0.74 (uniform:bits=2, at twice the bits, measures 2.03)
    attention_error = 0.85


# -- the transform ---------------------------------------------------------------------------------
def test_nsn_is_normalize_shift_normalize_and_restores_exactly():
    k, _ = kv_data(t=256, dtype=mx.float32)
    x3, s1, s2, o = nsn(k, 64)
    x = np.array(k, dtype=np.float64)
    n1 = np.linalg.norm(x, axis=-1, keepdims=True) / np.sqrt(128)
    x1 = (x / n1).reshape(1, 2, 4, 64, 128)
    mean = x1.mean(axis=3, keepdims=True)
    x2 = (x1 - mean).reshape(1, 2, 256, 128)
    n2 = np.linalg.norm(x2, axis=-1, keepdims=True) / np.sqrt(128)
    np.testing.assert_allclose(np.array(s1), n1, rtol=1e-5)
    np.testing.assert_allclose(np.array(o), mean[:, :, :, 0], rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(np.array(s2), n2, rtol=1e-4)
    np.testing.assert_allclose(np.array(x3), x2 / n2, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(np.sum(np.array(x3) ** 2, -1), 128.0, rtol=1e-5)  # ||x3||^2 = D
    back = np.array(s1 * (s2 * x3 + mx.repeat(o, 64, axis=2)))
    np.testing.assert_allclose(back, x, rtol=1e-4, atol=1e-4)


def test_the_transform_brings_keys_with_outlier_channels_to_a_standard_normal():
    """kv_data's keys have a per-channel mean and a few outlier channels: after the transform
    and the rotation every channel has mean 0 and deviation 1 (measured 0.00 and 1.00); with
    the shift left out a channel keeps a mean far from 0 (measured up to 2.4)."""
    k, _ = kv_data(t=1024, seed=4, dtype=mx.float32)
    rot = Rotation(128)
    x3, *_ = nsn(k, 128)
    y = np.array(rot.forward(x3)).reshape(-1, 128)
    assert np.abs(y.mean(0)).max() < 0.2 and np.abs(y.std(0) - 1).max() < 0.2
    z = np.array(rot.forward(k / mx.sqrt(mx.mean(k * k, -1, keepdims=True)))).reshape(-1, 128)
    assert np.abs(z.mean(0)).max() > 1.0  # normalize and rotate only: the mean stays


@pytest.mark.parametrize("dim,block", [(128, 128), (64, 64), (80, 16), (96, 32)])
def test_the_rotation_is_the_sylvester_hadamard_by_blocks(dim, block):
    h = np.ones((1, 1))
    while h.shape[0] < block:
        h = np.block([[h, h], [h, -h]])
    want = np.kron(np.eye(dim // block), h / np.sqrt(block))
    x = np.random.default_rng(dim).normal(size=(3, dim)).astype(np.float32)
    rot = Rotation(dim)
    np.testing.assert_allclose(np.array(rot.forward(mx.array(x))), x @ want.T, atol=1e-5)
    np.testing.assert_allclose(np.array(rot.inverse(rot.forward(mx.array(x)))), x, atol=1e-5)
    assert rot.arrays() == {}


# -- the universal codebooks -----------------------------------------------------------------------
def test_the_shipped_books_have_their_widths_shapes_and_beat_scalar_codes_on_gaussians():
    """On fresh N(0, 1) samples the k-means books' error per channel is below the Lloyd-Max
    scalar quantizer's at the same rate (measured 0.322 / 0.363 at one bit, 0.097 / 0.117 at
    two, 0.030 / 0.035 at three, 0.0083 / 0.0095 at four)."""
    rng = np.random.default_rng(123)
    for bits, (dim, k) in {1: (8, 256), 2: (4, 256), 3: (2, 64), 4: (2, 256)}.items():
        book = np.array(codebook(bits))
        assert book.shape == (k, dim) and subvector(bits) == dim
        x = rng.standard_normal((1 << 15, dim))
        idx = np.argmin(np.sum(book * book, 1) - 2 * x @ book.T, 1)
        mse = np.mean((x - book[idx]) ** 2)
        assert mse < 0.95 * lloyd_max_gaussian(bits).mse, (bits, mse)
    for bits in (5, 8):  # scalar widths: the Gaussian Lloyd-Max levels themselves
        assert subvector(bits) == 1
        np.testing.assert_array_equal(
            np.array(codebook(bits))[:, 0], lloyd_max_gaussian(bits).centroids
        )


def test_the_books_are_trained_on_seeded_gaussian_samples_alone():
    """``train`` is deterministic (numpy's seeded generator, no model data) and the shipped
    book is a Lloyd fixed point: one more iteration on fresh samples moves it little."""
    a, b = train(4, samples=1 << 12, iters=3), train(4, samples=1 << 12, iters=3)
    np.testing.assert_array_equal(a, b)
    assert not np.array_equal(a, train(4, samples=1 << 12, iters=3, seed=1))
    book = np.array(codebook(2))
    x = np.random.default_rng(7).standard_normal((1 << 17, 4))
    idx = np.argmin(np.sum(book * book, 1) - 2 * x @ book.T, 1)
    counts = np.bincount(idx, minlength=256)
    sums = np.stack([np.bincount(idx, weights=x[:, j], minlength=256) for j in range(4)], 1)
    moved = np.linalg.norm(sums / np.maximum(counts, 1)[:, None] - book, axis=1)
    assert counts.min() > 0 and np.median(moved) < 0.05
    with pytest.raises(ValueError, match="k-means books are for bits"):
        train(5)


def test_every_layer_and_side_codes_with_the_same_book_and_fits_nothing():
    caches = make_cache(conformance_model(num_hidden_layers=3), "nsnquant:bits=2")
    k, v = kv_data(t=256)
    for c in caches:
        c.update_and_fetch(k, v)
        for codec in (c.tiers[0].key_codec, c.tiers[0].value_codec):
            assert codec.state() == {} and codec.state_nbytes == 0
    assert codebook(2) is codebook(2)


# -- the codes -------------------------------------------------------------------------------------
@pytest.mark.parametrize("bits", [1, 2, 3, 4, 6])
def test_scores_and_mix_read_the_codes_a_tile_at_a_time(bits, monkeypatch):
    monkeypatch.setattr(ncodec, "TILE", 128)
    k, v = kv_data(t=384, d=128)
    codec = NSNQuantCodec(bits, group=64)
    pk, pv = codec.encode(k), codec.encode(v)
    assert len(pk.tiles(ncodec.TILE)) == 3
    kk, _ = assert_scores_and_mix_decoded(codec, pk, codec, pv, seed=bits)
    rotated = codec.decode_rotated_as(pk, mx.float32)
    assert rel_error(rotated, codec.rotation.forward(kk)) < 1e-5


def test_encoding_a_prefill_chunk_holds_one_block_of_distances_at_a_time():
    """The nearest-codeword search of a 512-token chunk of 2 heads at 4 bits (65,536
    sub-vectors against 256 codewords: 64 MiB of distances at once) evaluates 4 MiB blocks:
    measured 5.3 MiB of transient (68 MiB when every block was built before the first was
    reduced)."""
    k, _ = kv_data(t=512)
    codec = NSNQuantCodec(4)
    codec.check(128, mx.float16)
    mx.eval(k)
    mx.synchronize()
    mx.reset_peak_memory()
    base = mx.get_active_memory()
    p = codec.encode(k)
    mx.eval(p.data)
    assert mx.get_peak_memory() - base < 12 * 2**20


def test_a_token_is_its_gain_times_its_codewords_plus_its_norm_times_the_blocks_shift():
    """``H x_hat = a y_hat + n (H o)`` from the stored arrays alone (numpy), and ``a`` is the
    least-squares gain: no other scale of the codewords reconstructs the token better."""
    k, _ = kv_data(t=128, d=64, dtype=mx.float32)
    codec = NSNQuantCodec(2, group=64)
    p = codec.encode(k)
    book = np.array(codebook(2))
    idx = np.array(ncodec.unpack(p.data["codes"], 8, 16))
    y_hat = book[idx].reshape(1, 2, 128, 64)
    f = lambda a: np.array(a.astype(mx.float32))  # noqa: E731
    want = f(p.data["scale"]) * y_hat + f(p.data["norm"]) * np.repeat(f(p.data["shift"]), 64, 2)
    got = f(codec.decode_rotated_as(p, mx.float32))
    np.testing.assert_allclose(want, got, rtol=1e-5, atol=1e-5)
    err = rel_error(codec.decode(p), k)
    p.data["scale"] = p.data["scale"] * 1.05
    assert rel_error(codec.decode(p), k) > err


def test_bytes_of_a_known_input_are_the_codes_two_scales_a_token_and_a_shift_a_block():
    """2 heads, 1,000 tokens, head dim 128, 2 bits, blocks of 128: 7 blocks coded (896
    tokens), 104 tokens of the 8th waiting in fp16."""
    k, v = kv_data(b=1, h=2, t=1000, d=128)
    c = NSNQuantCache(bits=2)
    c.update_and_fetch(k, v)
    assert [s.tokens for s in c.segments()] == [896, 104]
    per_side = 2 * (896 * (128 * 2 // 8 + 2 + 2) + 7 * 128 * 2)
    fp16 = 104 * 2 * 128 * 2 * 2
    assert c.logical_nbytes == 2 * per_side + fp16
    body = c.segments()[0]
    assert body.keys.nbytes * 8 / (2 * 896 * 128) == 2.375  # 2 + 0.375 bits an entry


def test_sinks_window_and_the_block_being_filled_stay_fp16():
    c = make("nsnquant:bits=2,sinks=16,window=40,group=64")
    sinks, body, win = assert_exact_ends(c, body_error=0.3)
    assert (sinks.tokens, body.tokens) == (16, 640) and 40 <= win.tokens < 40 + 64


# -- save / load and settings ----------------------------------------------------------------------
def test_save_load_keeps_the_codes_and_a_seeded_rotation(tmp_path):
    c = make("nsnquant:bits=2,seed=2")
    d = assert_reloads_alike(c, tmp_path / "n.safetensors")
    assert isinstance(d, NSNQuantCache)
    assert set(c.segments()[0].keys.data) == {"codes", "scale", "norm", "shift"}
    assert set(c.tiers[0].key_codec.state()) == {"rot.signs"}
    assert_tampered_state_refused(c, "codec.tier0.k.rot.signs", "saved rotation does not match")


def test_codecs_follow_the_settings():
    c = NSNQuantCache(bits=3, value_bits=1, group=64, seed=5, window=8, sinks=2)
    kc, vc = c.tiers[0].key_codec, c.tiers[0].value_codec
    assert (kc.bits, kc.dim, vc.bits, vc.dim) == (3, 2, 1, 8)
    assert kc.group == vc.group == kc.block == 64 and kc.seed == vc.seed == 5
    assert (c.window, c.sinks) == (8, 2)


BAD = (
    ("nsnquant:bits=0", r"bits must be >= 1"),
    ("nsnquant:key_bits=9", r"key_bits must be <= 8"),
    ("nsnquant:group=0", r"group must be >= 1"),
    ("nsnquant:seed=-1", r"seed must be >= 0"),
    ("nsnquant:sinks=-1", r"sinks must be >= 0"),
    ("nsnquant:dim=4", r"has no parameter 'dim'"),
)


test_make_cache_refuses_bad_parameters_naming_them = spec_refusals_test(BAD)


def test_odd_head_dims_are_refused_and_even_ones_code():
    with pytest.raises(ValueError, match=r"nsnquant: value head dim 63 is odd"):
        NSNQuantCache().check_dims(64, 63)
    with pytest.raises(ValueError, match="not a multiple of the 8-channel sub-vectors"):
        NSNQuantCodec(1).check(36, mx.float16)
    assert_codes_head_dims("nsnquant:bits=4", 0.15)
