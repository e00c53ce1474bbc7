"""SVDq: the conformance suite, and what is SVDq's own."""

import itertools
import math

import mlx.core as mx
import numpy as np
import pytest

from velox_core import make, make_cache
from velox_svdq import (
    METHOD,
    RopeSpec,
    SVDqCache,
    SVDqKeys,
    channel_widths,
    parse_schedule,
)
from velox_testing import CacheConformance, feed, kv_data, rel_error, tiny_model

BASE = 10000.0
D = 128


class TestSVDq(CacheConformance):
    # 2 bits per latent channel on average over 80 of 128 channels (32 B of key codes per token
    # and head), 4-bit values, positions once per block; kv_data has no low-rank structure
    # (iid channels), so dropping 48 latent channels costs it much of its key energy
    max_memory_ratio = 0.27  # measured 0.264 at 2,048 tokens (buffer slack included)
    attention_error = 0.9  # measured 0.86
    same_greedy_tokens = 32

    def make(self):
        return SVDqCache(rope_base=BASE, calibration=64)

    def make_precise(self):  # no rope_base: make_cache binds the model's RoPE
        return SVDqCache(schedule="8", value_bits=8, calibration=32, group=32)


class TestSVDqFullRank(CacheConformance):
    # every latent channel at 8 bits, fp16 values: on any data only the 8-bit rounding is lost
    max_memory_ratio = 0.84  # measured 0.828
    attention_error = 0.02  # measured 0.004

    def make(self):
        return SVDqCache(schedule="8", value_bits=16, rope_base=BASE, calibration=64, group=32)


def _roped(k: mx.array, offset: int = 0) -> mx.array:
    return mx.fast.rope(k, k.shape[-1], traditional=False, base=BASE, scale=1.0, offset=offset)


def _low_rank_keys(rank: int, t: int = 512, decay: float = 0.7, seed: int = 0) -> mx.array:
    """Pre-RoPE keys ``(1, 2, t, D)`` of exact rank ``rank`` per head, singular values falling
    by ``decay`` per direction."""
    rng = np.random.default_rng(seed)
    basis = np.linalg.qr(rng.normal(size=(1, 2, D, rank)))[0]
    coef = rng.normal(size=(1, 2, t, rank)) * (4.0 * decay ** np.arange(rank))
    return mx.array((coef @ np.swapaxes(basis, -1, -2)).astype(np.float32))


def _encode(codec: SVDqKeys, k: mx.array, offset: int = 0):
    pos = mx.arange(offset, offset + k.shape[2], dtype=mx.int32)
    return codec.encode(k, pos)


# -- the mathematics -----------------------------------------------------------------------------
def test_basis_is_the_top_singular_subspace_of_the_pre_rope_keys():
    pre = _low_rank_keys(rank=40, t=256, decay=0.9)
    codec = SVDqKeys("8-4-2-0-0-0-0-0", rope_base=BASE)  # 48 channels kept
    _encode(codec, _roped(pre))
    basis = np.array(codec.state()["basis"].astype(mx.float32))  # (1, 2, D, 48)
    assert basis.shape == (1, 2, D, 48)
    for h in range(2):
        v = basis[0, h]
        assert np.abs(v.T @ v - np.eye(48)).max() < 2e-3  # orthonormal up to fp16 rounding
        _, s, vt = np.linalg.svd(np.array(pre[0, h]), full_matrices=False)
        top = vt[:16].T  # the 16 largest singular directions: the 8-bit group
        assert np.abs(top.T @ v[:, :16] @ v[:, :16].T @ top - np.eye(16)).max() < 5e-3
        # the latent channels' energies are the squared singular values, in order
        lat = np.array(pre[0, h]) @ v
        energy = (lat**2).sum(axis=0)
        assert np.allclose(energy[:16], s[:16] ** 2, rtol=1e-2)
        assert np.all(np.diff(energy[:16]) <= 0)


def test_scores_from_the_latent_equal_scores_against_the_reconstructed_roped_keys():
    pre = _low_rank_keys(rank=24, t=192)
    offset = 1000
    for center in (False, True):
        codec = SVDqKeys("8-4-2-1-1-0-0-0", rope_base=BASE, center=center)
        packed = _encode(codec, _roped(pre, offset), offset)
        # the reconstruction by hand: latent @ basis^T (+ mean), RoPE'd by MLX's own kernel
        v = codec.state()["basis"].astype(mx.float32)
        rec = codec.latent(packed) @ mx.swapaxes(v, -1, -2)
        if center:
            rec = rec + codec.state()["mean"].astype(mx.float32)[:, :, None]
        roped = _roped(rec, offset)
        q = mx.random.normal((1, 2, 3, D), key=mx.random.key(0))
        got = codec.scores(q, packed)
        want = q @ mx.swapaxes(roped, -1, -2)
        assert rel_error(got, want) < 1e-4  # float32 cos/sin tables against MLX's kernel
        assert rel_error(codec.decode(packed), roped) < 1e-4
        shifted = q @ mx.swapaxes(_roped(rec, offset + 1), -1, -2)  # one position off
        assert rel_error(got, shifted) > 1e-2


def test_post_rope_scores_rotate_the_query_into_the_basis():
    k, _ = kv_data(t=128)
    for center in (False, True):
        codec = SVDqKeys("8-4-2-1-1-0-0-0", pre_rope=False, center=center)
        packed = codec.encode(k)
        q = mx.random.normal((1, 2, 4, D), key=mx.random.key(1))
        want = q @ mx.swapaxes(codec.decode(packed), -1, -2)  # against the rebuilt keys
        assert rel_error(codec.scores(q, packed), want) < 1e-5


def test_pre_rope_keeps_a_low_rank_key_that_post_rope_loses():
    """Low-rank pre-RoPE keys stay low-rank in the latent only before RoPE."""
    pre = _low_rank_keys(rank=12, t=512)
    post = _roped(pre)
    sched = "8-0-0-0-0-0-0-0"  # 16 latent channels at 8 bits: enough for rank 12
    err = {}
    for pre_rope in (True, False):
        codec = SVDqKeys(sched, pre_rope=pre_rope, **({"rope_base": BASE} if pre_rope else {}))
        err[pre_rope] = rel_error(codec.decode(_encode(codec, post)), post)
    assert err[True] < 0.01
    assert err[False] > 10 * err[True]


def test_precision_falls_with_the_singular_value():
    """Each group's relative latent error follows its width: about 2**-b of the range."""
    pre = _low_rank_keys(rank=64, t=512, decay=0.95)
    codec = SVDqKeys("8-4-2-1-0-0-0-0", rope_base=BASE)
    packed = _encode(codec, _roped(pre))
    v = codec.state()["basis"].astype(mx.float32)
    exact = np.array(pre @ v)
    got = np.array(codec.latent(packed))
    rel = []
    for g in range(4):
        sl = slice(16 * g, 16 * g + 16)
        rel.append(np.abs(got[..., sl] - exact[..., sl]).max() / np.ptp(exact[..., sl]))
    widths = (8, 4, 2, 1)
    for r, w in zip(rel, widths):
        assert r <= 0.5 / ((1 << w) - 1) + 2e-3  # half a step of the per-block range
    assert rel[0] < rel[1] < rel[2] < rel[3]
    assert {k for k in packed.data if k.startswith("codes")} == {f"codes{w}" for w in widths}


# -- resident bytes ----------------------------------------------------------------------------
def _key_bytes(widths, rank, t, group, h=2, b=1):
    """Predicted bytes of ``t`` coded keys: packed codes per width, fp16 scale and zero per
    kept channel and block, one int32 position per block."""
    per = channel_widths(parse_schedule(widths), D, rank)
    words = sum(-(-per.count(w) * w // 32) for w in set(per))
    return b * h * t * 4 * words + b * h * (t // group) * len(per) * 4 + b * (t // group) * 4


@pytest.mark.parametrize("schedule", ["8-4-2-1-1-0-0-0", "4"])
def test_resident_bytes_fall_with_rank_as_predicted(schedule):
    k, v = kv_data(t=1024, d=D)
    k = _roped(k)
    sizes = []
    for rank in (8, 16, 32, 48, 64):
        codec = SVDqKeys(schedule, rank=rank, rope_base=BASE)
        packed = _encode(codec, k)
        assert packed.nbytes == _key_bytes(schedule, rank, 1024, 64)
        assert codec.state_nbytes == 2 * D * rank * 2 + 4 * 64 + 8  # fp16 basis + RoPE arrays
        # the whole cache: the key codes and basis, the 4-bit values, one fp16 token waiting
        c = SVDqCache(schedule=schedule, rank=rank, rope_base=BASE, calibration=64)
        feed(c, k, v, 256)
        mx.eval(c.state)
        coded = 1024 - 64  # the window keeps the last flush's remainder (>= 1 token) in fp16
        values = 2 * coded * (64 + 2 * 2 * 2)  # 4-bit codes + fp16 scale, zero per 64 channels
        fp16 = 2 * 64 * D * 2 * 2
        want = _key_bytes(schedule, rank, coded, 64) + codec.state_nbytes + values + fp16
        assert c.logical_nbytes == want
        sizes.append(c.logical_nbytes)
    assert all(a < b for a, b in itertools.pairwise(sizes))


# -- fitting and coding order --------------------------------------------------------------------
def test_basis_fitted_once_on_the_calibration_tokens_then_kept():
    k, v = kv_data(t=400)
    k = _roped(k)
    c = SVDqCache(rope_base=BASE, calibration=200)
    c.update_and_fetch(k[:, :, :150], v[:, :, :150])
    assert not c.fitted and c.size() == 150  # all fp16, waiting
    c.update_and_fetch(k[:, :, 150:260], v[:, :, 150:260])
    assert c.fitted
    basis = np.array(c.tiers[0].key_codec.state()["basis"])
    # fitted on every whole block the window held: 256 tokens (4 blocks of 64)
    ref = SVDqKeys(rope_base=BASE)
    _encode(ref, k[:, :, :256])
    assert np.array_equal(basis, np.array(ref.state()["basis"]))
    for i in range(260, 400):  # decode tokens are projected onto the same basis
        c.update_and_fetch(k[:, :, i : i + 1], v[:, :, i : i + 1])
    assert np.array_equal(basis, np.array(c.tiers[0].key_codec.state()["basis"]))
    assert c.offset == 400 and c.stored.coded[0][0].tokens == 384


def test_make_cache_binds_each_model_rope():
    for family, base in (("llama", 10000.0), ("mistral", 1e6)):
        caches = make_cache(tiny_model(family), SVDqCache(calibration=32))
        assert caches[0].tiers[0].key_codec._rope.same_as(RopeSpec.from_base(base, 64))
    with pytest.raises(ValueError, match="disagree"):
        make_cache(tiny_model("llama"), SVDqCache(rope_base=500000.0))


def test_registered_and_spec():
    assert METHOD.name == "svdq" and METHOD.cache_class is SVDqCache
    c = make("svdq:schedule=8-4-2-1-1-0-0-0,rank=48,group=32,value_bits=2,rope_base=10000")
    assert c.cfg.schedule == "8-4-2-1-1-0-0-0" and c.cfg.rank == 48
    assert SVDqCache(schedule=(4, 2, 2, 1)).cfg.schedule == "4-2-2-1"
    assert SVDqCache(schedule=4).cfg.schedule == "4"


# -- bad parameters ----------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("params", "err", "match"),
    [
        ({"schedule": "1-2"}, ValueError, "not increase"),
        ({"schedule": "8-x"}, ValueError, "joined by"),
        ({"schedule": "9-4"}, ValueError, "schedule"),
        ({"schedule": "0-0"}, ValueError, "first group"),
        ({"schedule": ""}, ValueError, "schedule"),
        ({"schedule": 2.5}, TypeError, "schedule"),
        ({"schedule": True}, TypeError, "schedule"),
        ({"rank": 0}, ValueError, "rank"),
        ({"rank": 4.0}, TypeError, "rank"),
        ({"group": 0}, ValueError, "group"),
        ({"value_bits": 1}, ValueError, "value_bits"),
        ({"value_bits": 12}, ValueError, "value_bits"),
        ({"calibration": 0}, ValueError, "calibration"),
        ({"center": 1}, TypeError, "center"),
        ({"window": -1}, ValueError, "window"),
        ({"pre_rope": "no"}, TypeError, "pre_rope"),
        ({"rope_base": 0.5}, ValueError, "rope_base"),
        ({"rope_dims": 64}, ValueError, "need rope_base"),
        ({"pre_rope": False, "rope_base": BASE}, ValueError, "need pre_rope"),
        ({"bits": 4}, ValueError, "unknown parameter"),
    ],
)
def test_bad_parameters_refused(params, err, match):
    with pytest.raises(err, match=match):
        SVDqCache(**params)


def test_bad_shapes_refused_before_the_first_forward():
    model = tiny_model("llama")  # head dim 64
    with pytest.raises(ValueError, match="rank=100 exceeds"):
        make_cache(model, SVDqCache(rank=100))
    with pytest.raises(ValueError, match="must divide the head dim"):
        make_cache(model, SVDqCache(schedule="8-4-2"))
    with pytest.raises(ValueError, match="group"):
        make_cache(model, SVDqCache(group=48))  # the value groups must divide 64
    with pytest.raises(ValueError, match="RoPE"):
        SVDqCache().update_and_fetch(*kv_data(t=8))  # standalone, no RoPE known
    codec = SVDqKeys(rope_base=BASE)
    k, _ = kv_data(t=128)
    with pytest.raises(ValueError, match="consecutive"):
        codec.encode(k, mx.concatenate([mx.arange(32), mx.arange(100, 196)]).astype(mx.int32))
    with pytest.raises(ValueError, match="multiple of group"):
        codec.encode(k[:, :, :100], mx.arange(100))


def test_attention_on_low_rank_keys_is_close():
    """On keys with the structure the paper relies on, the default is accurate."""
    pre = _low_rank_keys(rank=16, t=512)
    k = _roped(pre)
    _, v = kv_data(t=512)
    c = SVDqCache(rope_base=BASE, calibration=256)
    c.update_and_fetch(k.astype(mx.float16), v)
    q = (mx.random.normal((1, 4, 1, D), key=mx.random.key(3)) + k[:, :1, -1:]).astype(mx.float16)
    scale = 1 / math.sqrt(D)
    ref = mx.fast.scaled_dot_product_attention(q, k.astype(mx.float16), v, scale=scale)
    assert rel_error(c.attend(q, scale=scale), ref) < 0.05
