"""GEAR: the conformance suite, and GEAR's mathematics against an independent numpy version."""

import itertools

import mlx.core as mx
import numpy as np
import pytest

from velox_core import Packed, Uniform, load_cache, make, save_cache
from velox_gear import GearCache, GearCodec
from velox_testing import CacheConformance, assert_head_dim_refused, feed, kv_data, rel_error


class TestGear4(CacheConformance):
    spec = "gear:bits=4"
    precise_spec = "gear:bits=8"

    max_memory_ratio = 0.46  # measured 0.446: KIVI-4's 0.31 + rank-4 factors + 2% outliers
    attention_error = 0.15  # measured 0.12 at 2,048 tokens (KIVI-4 alone: 0.18)
    same_greedy_tokens = 32

    bad_settings = (
        {"rank": -1},
        {"rank": 65},  # above the 64-token block
        {"outliers": 0.6},
        {"outliers": -0.01},
        {"iters": 0},
        {"group": 0},
        {"seed": -1},
        {"bits": 1},
    )


class TestGear2(CacheConformance):
    spec = "gear:bits=2"
    precise_spec = "gear:bits=8"

    max_memory_ratio = 0.33  # measured 0.321 (KIVI-2 alone: 0.187)
    attention_error = 0.75  # measured 0.65 on kv_data's peaked logits (KIVI-2 alone: 0.95)


def _np_gear(x: np.ndarray, bits: int, rank: int, outliers: float):
    """GEAR of one key block ``(n, D)`` in numpy: outliers out (replaced by their channel's
    mean), per-channel asymmetric codes with fp16 scale and minimum, exact outliers, the
    residual's best rank-``rank`` approximation (SVD). Returns the reconstruction and the
    outliers' flat indices."""
    n, d = x.shape
    k = int(outliers * n * d / 2 + 1e-6)
    flat = x.reshape(-1)
    order = np.argsort(flat, kind="stable")
    idx = np.concatenate([order[-k:], order[:k]]) if k else np.zeros(0, int)
    xq = x.copy().reshape(-1)
    xq[idx] = np.broadcast_to(x.mean(axis=0), x.shape).reshape(-1)[idx]
    xq = xq.reshape(n, d)
    lo = xq.min(axis=0).astype(np.float16).astype(np.float64)
    scale = ((xq.max(axis=0) - xq.min(axis=0)) / (2**bits - 1)).astype(np.float16)
    scale = np.maximum(scale.astype(np.float64), 1e-8)
    deq = np.clip(np.round((xq - lo) / scale), 0, 2**bits - 1) * scale + lo
    sparse = np.zeros(n * d)
    sparse[idx] = (x - deq).reshape(-1)[idx]
    resid = x - deq - sparse.reshape(n, d)
    u, s, vt = np.linalg.svd(resid, full_matrices=False)
    low = (u[:, :rank] * s[:rank]) @ vt[:rank]
    return deq + sparse.reshape(n, d) + low, set(idx.tolist())


def _block(seed=0, n=64, d=128):
    k, _ = kv_data(h=1, t=n, d=d, seed=seed)
    return k


@pytest.mark.parametrize("rank,outliers", [(0, 0.02), (4, 0.0), (4, 0.02), (8, 0.05)])
def test_reconstruction_matches_an_independent_numpy_gear(rank, outliers):
    x = _block()
    codec = GearCodec(2, 64, "channel", rank=rank, outliers=outliers)
    packed = codec.encode(x)
    xn = np.array(x[0, 0].astype(mx.float32), dtype=np.float64)
    ref, ref_idx = _np_gear(xn, 2, rank, outliers)
    if outliers:
        got_idx = set(np.array(packed.data["sp_idx"]).reshape(-1).tolist())
        assert got_idx == ref_idx  # the same entries, largest and smallest, are kept
    got = np.array(codec.decode(packed)[0, 0], dtype=np.float64)
    e_got = np.linalg.norm(got - xn) / np.linalg.norm(xn)
    e_ref = np.linalg.norm(ref - xn) / np.linalg.norm(xn)
    # SVD is the optimum; 3 power iterations and fp16 factors come within a few percent
    assert e_ref * 0.999 <= e_got <= e_ref * 1.05 + 1e-4


def test_decode_is_codes_plus_low_rank_plus_sparse():
    """The record's three parts, summed in numpy, are what decode returns."""
    k, _ = kv_data(t=192, d=128, seed=3)
    codec = GearCodec(2, 64, "channel", rank=4, outliers=0.02)
    p = codec.encode(k)
    base = Uniform(2, 64, "channel")
    codes = {n: p.data[n] for n in ("codes", "scale", "zero")}
    deq = np.array(base.decode(Packed(codes, 192, 64, frozenset({"scale", "zero"}))))
    a = np.array(p.data["lr_a"].astype(mx.float32)).reshape(1, 2, 3, 64, 4)
    b = np.array(p.data["lr_b"].astype(mx.float32))
    low = np.einsum("bhpnr,bhpdr->bhpnd", a, b).reshape(1, 2, 192, 128)
    sparse = np.zeros((1, 2, 3, 64 * 128), np.float32)
    idx = np.array(p.data["sp_idx"]).astype(np.int64)
    val = np.array(p.data["sp_val"].astype(mx.float32))
    for h in range(2):
        for blk in range(3):
            np.add.at(sparse[0, h, blk], idx[0, h, blk], val[0, h, blk])
    total = deq + low + sparse.reshape(1, 2, 192, 128)
    np.testing.assert_allclose(np.array(codec.decode(p)), total, rtol=1e-5, atol=1e-4)
    assert np.count_nonzero(val) == val.size  # every kept outlier corrects its entry


@pytest.mark.parametrize("axis", ["channel", "token"])
def test_error_falls_as_rank_and_outliers_grow(axis):
    k, v = kv_data(t=256, d=128, seed=1)
    x = k if axis == "channel" else v

    def err(rank, outliers):
        c = GearCodec(2, 64, axis, rank=rank, outliers=outliers)
        return rel_error(c.decode(c.encode(x)), x)

    by_rank = [err(r, 0.0) for r in (0, 2, 4, 8)]
    by_outliers = [err(0, s) for s in (0.0, 0.01, 0.02, 0.05)]
    assert all(a > b for a, b in itertools.pairwise(by_rank))
    assert all(a > b for a, b in itertools.pairwise(by_outliers))
    assert err(4, 0.02) < min(by_rank[2], by_outliers[2])  # the parts add up


def test_planted_outliers_are_removed_far_below_the_backbone_alone():
    rng = np.random.default_rng(7)
    x = rng.normal(0, 1, size=(1, 2, 256, 128))
    hits = rng.random(x.shape) < 0.005  # 0.5% of entries, 60x the others, either sign
    x = np.where(hits, rng.choice([-60.0, 60.0], size=x.shape), x)
    x = mx.array(x.astype(np.float16))
    for axis in ("channel", "token"):
        backbone = Uniform(4, 64, axis)
        gear = GearCodec(4, 64, axis, rank=4, outliers=0.02)
        e_base = rel_error(backbone.decode(backbone.encode(x)), x)
        e_gear = rel_error(gear.decode(gear.encode(x)), x)
        assert e_gear < 0.1 * e_base


def test_compressed_scores_and_mix_equal_the_decoded_block():
    k, v = kv_data(t=192, d=128, seed=2)
    q = mx.random.normal((1, 2, 5, 128), key=mx.random.key(0))
    w = mx.softmax(mx.random.normal((1, 2, 5, 192), key=mx.random.key(1)), axis=-1)
    for axis, x in (("channel", k), ("token", v)):
        c = GearCodec(2, 64, axis)
        p = c.encode(x)
        xh = c.decode(p)
        assert rel_error(c.scores(q, p), q @ mx.swapaxes(xh, -1, -2)) < 1e-5
        assert rel_error(c.mix(w, p), w @ xh) < 1e-5


def test_exact_byte_count_of_a_known_input():
    """128 tokens, 2 heads, D=128, 2 bits, rank 4, 2% outliers: int(0.02*64*128/2) = 81 per
    sign and block. Keys: codes 8 words x 4 B per token, fp16 scale and minimum per channel
    and block, lr_a 4 fp16 per token, lr_b 128x4 fp16 and 162 outliers (uint16 + fp16) per
    block. Values: the same, their scale and minimum per token and 64 channels."""
    k, v = kv_data(t=128, d=128, seed=4)
    c = GearCache(bits=2)
    c.update_and_fetch(k, v)
    heads, tokens, blocks = 2, 128, 2
    codes = heads * tokens * 8 * 4
    factors = heads * (tokens * 4 * 2 + blocks * 128 * 4 * 2)
    sparse = heads * blocks * 162 * (2 + 2)
    key_scales = heads * blocks * 128 * 2 * 2
    value_scales = heads * tokens * 2 * 2 * 2
    assert c.nbytes == 2 * (codes + factors + sparse) + key_scales + value_scales


def test_partial_block_waits_in_fp16():
    k, v = kv_data(t=100, d=128, seed=5)
    c = GearCache(bits=2)
    for i in range(100):
        c.update_and_fetch(k[:, :, i : i + 1], v[:, :, i : i + 1])
    body, win = c.segments()
    assert body.tokens == 64 and win.tokens == 36
    kk, vv = c.keys_and_values()
    assert mx.array_equal(kk[:, :, 64:], k[:, :, 64:])
    assert mx.array_equal(vv[:, :, 64:], v[:, :, 64:])


def test_save_load_round_trip_is_exact(tmp_path):
    k, v = kv_data(t=200, d=128, seed=6)
    c = feed(make("gear:bits=2,rank=2,outliers=0.01"), k, v)
    save_cache(tmp_path / "g.safetensors", [c])
    (back,) = load_cache(tmp_path / "g.safetensors")
    assert back.nbytes == c.nbytes and back.config() == c.config()
    a, b = c.keys_and_values(), back.keys_and_values()
    assert mx.array_equal(a[0], b[0]) and mx.array_equal(a[1], b[1])


def test_make_cache_refuses_a_head_dim_naming_gear_and_its_parameter():
    why = "group=64 must divide the value head dim 80"
    assert_head_dim_refused("gear", why, "gear:group=16")
