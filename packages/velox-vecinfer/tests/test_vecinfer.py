"""VecInfer: the conformance suite, and what is VecInfer's own."""

import itertools
import math

import mlx.core as mx
import numpy as np
import pytest

from velox_core import make
from velox_core.ops import assign, pack, unpack
from velox_testing import CacheConformance, feed, kv_data, rel_error
from velox_vecinfer import METHOD, VecInfer, VecInferCache


class TestVecInfer2(CacheConformance):
    max_memory_ratio = 0.14  # 8-bit indices of 4 channels: 64 B of 512 per token and head
    attention_error = 0.75  # 2 bits a channel move the peaked logits of kv_data a lot
    same_greedy_tokens = 32

    bad_settings = (
        ({"bits": 2, "vector": 8}, "16 index bits"),
        ({"bits": 3}, "12 index bits"),
        ({"bits": 1.3}, "whole number"),
        ({"bits": 0.1, "vector": 1}, "whole number"),
        ({"bits": 0}, "positive"),
        ({"bits": "2"}, "number"),
        ({"bits": True}, "number"),
        ({"key_bits": 3}, "key_bits"),
        ({"value_bits": 3, "value_vector": 4}, "value_bits"),
        ({"vector": 3}, "1, 2, 4, 8"),
        ({"vector": 2.0}, "int"),
        ({"key_vector": 16}, "key_vector"),
        ({"smooth": 1}, "smooth"),
        ({"hadamard": "yes"}, "hadamard"),
        ({"iters": -1}, "iters"),
        ({"group": 64}, "unknown parameter"),
    )

    def make(self):
        return VecInferCache(bits=2, calibration=64)

    def make_precise(self):  # 256 levels a channel (a scalar codebook per head)
        return VecInferCache(bits=8, vector=1, calibration=16)


class TestVecInfer4Window(CacheConformance):
    max_memory_ratio = 0.3  # 8-bit indices of 2 channels, 2 sinks and a 32-token window
    attention_error = 0.3

    def make(self):
        return VecInferCache(bits=4, vector=2, calibration=32, sinks=2, window=32)

    def make_precise(self):
        return VecInferCache(bits=8, vector=1, calibration=16, sinks=2, window=32)


def _keys(t=256, h=2, d=128, seed=0, b=1):
    return kv_data(b=b, h=h, t=t, d=d, seed=seed)[0]


# -- the codec's mathematics ---------------------------------------------------------------------
def test_round_trip_error_is_small_and_falls_with_bits():
    x = _keys(t=256, seed=1)
    errs = []
    for bits in (1, 2, 3, 4):  # vector 2: 2, 4, 6, 8 index bits
        c = VecInfer(bits=bits, vector=2)
        errs.append(rel_error(c.decode(c.encode(x)), x))
    assert all(a > 1.2 * b for a, b in itertools.pairwise(errs)), errs
    # against random codes of the same codebook, and against the seeding alone (iters=0)
    c = VecInfer(bits=2, vector=2)
    p = c.encode(x)
    rand = mx.random.randint(0, c.size, (1, 2, 256, 64), key=mx.random.key(0))
    p_rand = type(p)({"codes": pack(rand, c.index_bits)}, 256)
    assert errs[1] < 0.4 * rel_error(c.decode(p_rand), x)
    seeded = VecInfer(bits=2, vector=2, iters=0)
    assert errs[1] < 0.95 * rel_error(seeded.decode(seeded.encode(x)), x)


@pytest.mark.parametrize(("bits", "vector"), [(2, 4), (1.25, 4), (3, 2), (1, 8), (3, 1)])
def test_codes_are_the_nearest_codewords_in_velox_bit_layout(bits, vector):
    x = _keys(t=96, d=64, seed=2)
    c = VecInfer(bits=bits, vector=vector)
    p = c.encode(x)
    ib, subs = c.index_bits, 64 // vector
    assert ib == round(bits * vector)
    assert set(p.data) == {"codes"}
    assert p.data["codes"].dtype == mx.uint32
    assert p.data["codes"].shape == (1, 2, 96, math.ceil(subs * ib / 32))
    # the indices are the nearest codewords of the transformed sub-vectors
    y = c.transform(x).reshape(2, 96 * subs, vector)
    want = assign(y, c.codebook[0]).reshape(1, 2, 96, subs)
    got = unpack(p.data["codes"], ib, subs)
    assert mx.array_equal(got.astype(mx.uint32), want)
    # read back from the raw words: sub-vector s at bits [s*ib, (s+1)*ib) of a little-endian
    # stream of uint32 words
    words = np.array(p.data["codes"][0, 1, 5]).astype(np.uint64)
    stream = sum(int(w) << (32 * i) for i, w in enumerate(words))
    raw = [(stream >> (s * ib)) & ((1 << ib) - 1) for s in range(subs)]
    assert raw == np.array(want[0, 1, 5]).tolist()


def test_dual_transformation_keeps_scores_and_suppresses_outliers():
    x = _keys(t=200, seed=3)  # channel scales and outlier channels
    c = VecInfer(bits=2)
    c.fit(x)
    peak = mx.max(mx.abs(x.astype(mx.float32)), axis=2)
    assert c.scale.shape == (1, 2, 128) and c.scale.dtype == mx.float32
    assert mx.allclose(c.scale, peak)  # lambda_i = max |K_i| over the calibration tokens
    q = mx.random.normal((1, 2, 6, 128), key=mx.random.key(4))  # 6 grouped query rows
    exact = q @ mx.swapaxes(x.astype(mx.float32), -1, -2)
    moved = c.transform_query(q) @ mx.swapaxes(c.transform(x), -1, -2)
    assert rel_error(moved, exact) < 1e-5
    assert rel_error(c.untransform(c.transform(x)), x) < 1e-5


def _kurtosis(a):
    """Of all entries of each head: 3 for a Gaussian, large for heavy tails (outliers)."""
    a = a.astype(mx.float32)
    a = a - mx.mean(a, axis=(2, 3), keepdims=True)
    return mx.mean(a**4, axis=(2, 3)) / mx.mean(a * a, axis=(2, 3)) ** 2


def test_dual_transformation_makes_keys_gaussian_like():
    """The paper's Figure 1: smoothing removes the outlier channels, the Hadamard transform
    then spreads what stands out within a token; together they leave no heavy tail."""
    rng = np.random.default_rng(0)
    x = np.array(_keys(t=256, seed=3).astype(mx.float32))  # outlier channels
    sd = x.std(axis=2, keepdims=True)
    spikes = rng.random(x.shape) < 0.005  # and rare large entries in any channel
    x = mx.array(np.where(spikes, x + 8 * sd * np.sign(rng.normal(size=x.shape)), x))
    x = x.astype(mx.float16)
    kurt = {"none": _kurtosis(x)}
    for name, kw in (
        ("smooth", {"hadamard": False}),
        ("hadamard", {"smooth": False}),
        ("both", {}),
    ):
        c = VecInfer(bits=2, **kw)
        c.fit(x)
        kurt[name] = _kurtosis(c.transform(x))
    assert mx.all(kurt["none"] > 50).item()
    assert mx.all(kurt["both"] < 3.3).item()  # a Gaussian's is 3
    assert mx.all(kurt["both"] < 0.8 * kurt["smooth"]).item()
    assert mx.all(kurt["both"] < kurt["hadamard"]).item()


@pytest.mark.parametrize("dim", [128, 96])
def test_hadamard_is_the_orthonormal_walsh_hadamard_matrix(dim):
    x = _keys(t=64, d=dim, seed=5)
    c = VecInfer(bits=2, smooth=False)
    c.fit(x)
    block = 128 if dim == 128 else 32  # 96: blocks of the largest power of two dividing it
    h = np.array([[1.0]])
    while h.shape[0] < block:
        h = np.block([[h, h], [h, -h]])
    full = np.kron(np.eye(dim // block), h / math.sqrt(block))  # no random signs, no permutation
    want = np.array(x.astype(mx.float32)) @ full.T
    assert np.allclose(np.array(c.transform(x)), want, atol=1e-3)
    assert rel_error(c.decode(c.encode(x)), x) < 0.5


def test_compressed_scores_and_mix_equal_decoded_attention():
    k, v = kv_data(t=80, d=64, seed=6)
    keys, values = VecInfer(bits=2), VecInfer(bits=2, smooth=False, hadamard=False)
    pk, pv = keys.encode(k), values.encode(v)
    q = mx.random.normal((1, 2, 6, 64), key=mx.random.key(7))  # 3 query heads x 2 tokens
    ref = q @ mx.swapaxes(keys.decode(pk), -1, -2)
    assert rel_error(keys.scores(q, pk), ref) < 1e-5
    w = mx.softmax(ref, axis=-1)
    for codec, p in ((values, pv), (keys, pk)):  # mix undoes the transform when there is one
        assert rel_error(codec.mix(w, p), w @ codec.decode(p)) < 1e-5
    assert keys.compressed_scores and values.compressed_mix


# -- the cache's behaviour ------------------------------------------------------------------------
def test_calibration_tokens_wait_in_fp16_and_fit_on_exactly_those():
    k, v = kv_data(t=300, seed=8)
    c = VecInferCache(bits=2, calibration=64, sinks=1)
    c.update_and_fetch(k[:, :, :40], v[:, :, :40])
    assert not c.calibrated and c.tiers[0].key_codec.state() == {}
    # fp16 keys and values only: the sink, and 39 tokens in a window buffer that grows 16
    # tokens at a time (48)
    assert c.logical_nbytes == 40 * 2 * 128 * 2 * 2 and c.nbytes == 49 * 2 * 128 * 2 * 2
    kk, vv = c.keys_and_values()
    assert mx.array_equal(kk, k[:, :, :40]) and mx.array_equal(vv, v[:, :, :40])
    c.update_and_fetch(k[:, :, 40:300], v[:, :, 40:300])  # completes them and goes on
    assert c.calibrated
    sink, body = c.segments()
    assert sink.tokens == 1 and body.tokens == 299
    peak = mx.max(mx.abs(k[:, :, 1:65].astype(mx.float32)), axis=2)  # after the sink
    assert mx.allclose(c.tiers[0].key_codec.scale, peak)
    assert not mx.allclose(peak, mx.max(mx.abs(k[:, :, 1:300].astype(mx.float32)), axis=2))
    alone = VecInfer(bits=2, smooth=False, hadamard=False)
    alone.fit(v[:, :, 1:65])
    assert mx.array_equal(alone.codebook, c.tiers[0].value_codec.codebook)


def test_codebooks_are_fitted_per_layer_head_and_sequence():
    k1, v1 = kv_data(t=100, seed=9)
    k2, v2 = kv_data(t=100, seed=10)
    k2, v2 = 3 * k2, v2 * v2  # a second sequence with other statistics
    batched = feed(
        VecInferCache(bits=2, calibration=64),
        mx.concatenate([k1, k2]),
        mx.concatenate([v1, v2]),
        (70, 1, 29),
    )
    kc = batched.tiers[0].key_codec
    assert kc.codebook.shape == (2, 2, 256, 4) and kc.scale.shape == (2, 2, 128)
    assert not mx.allclose(kc.codebook[0], kc.codebook[1])
    single = feed(VecInferCache(bits=2, calibration=64), k2, v2, (70, 1, 29))
    for codec, mine in zip(single._codecs(), batched._codecs()):
        for name, a in codec.state().items():
            b = mine.state()[name]
            assert mx.array_equal(a, b if name == "dim" else b[1:]), name
    q = mx.random.normal((1, 4, 1, 128), key=mx.random.key(11)).astype(mx.float16)
    one = batched.extract(1)
    assert mx.array_equal(one.attend(q, scale=0.1), single.attend(q, scale=0.1))
    # filter keeps the fitted rows aligned; merge (extend) joins them
    batched.filter([1])
    assert mx.array_equal(batched.attend(q, scale=0.1), single.attend(q, scale=0.1))
    merged = VecInferCache.stack([single, one])
    assert merged.tiers[0].key_codec.codebook.shape[0] == 2
    q2 = mx.concatenate([q, q])
    assert mx.array_equal(merged.attend(q2, scale=0.1)[1:], single.attend(q, scale=0.1))
    fresh = feed(VecInferCache(bits=2, calibration=64), k2[:, :, :10], v2[:, :, :10], 10)
    with pytest.raises(ValueError, match="calibrated"):
        VecInferCache.stack([single, fresh])


def test_state_round_trip_keeps_the_fit_and_the_attention():
    k, v = kv_data(t=120, seed=12)
    c = feed(VecInferCache(bits=1.5, calibration=32, window=8), k, v, (50, 1, 69))
    c2 = VecInferCache.from_state(c.state)
    for a, b in zip(c._codecs(), c2._codecs()):
        assert set(a.state()) == set(b.state())
        assert all(mx.array_equal(a.state()[n], b.state()[n]) for n in a.state())
    q = mx.random.normal((1, 4, 1, 128), key=mx.random.key(13)).astype(mx.float16)
    assert mx.array_equal(c.attend(q, scale=0.1), c2.attend(q, scale=0.1))
    kc = c.tiers[0].key_codec
    with pytest.raises(ValueError, match="state must hold"):
        kc.set_state({"codebook": kc.codebook, "dim": mx.array([128])})  # no scale
    with pytest.raises(ValueError, match="codebook"):
        kc.set_state({**kc.state(), "codebook": kc.codebook[..., :2]})


def test_memory_follows_the_packed_layout():
    k, v = kv_data(t=512)
    c = VecInferCache(bits=2, calibration=64)
    c.update_and_fetch(k, v)
    mx.eval(c.state)
    kc, vc = c.tiers[0].key_codec, c.tiers[0].value_codec
    state = 2 * 256 * 4 * 4 + 2 * 128 * 4 + 4 + 2 * 256 * 4 * 4 + 4  # codebooks, scale, dims
    assert kc.state_nbytes + vc.state_nbytes == state
    assert c.nbytes == 512 * 2 * (32 + 32) + state  # 32 indices of 8 bits, keys and values


def test_recommended_settings():
    for s in METHOD.recommended:
        c = make("vecinfer", **s)
        assert isinstance(c, VecInferCache)
    assert METHOD.recommended[-1] == {"bits": 2}  # the paper's main setting
    c = make("vecinfer")
    kc, vc = c.tiers[0].key_codec, c.tiers[0].value_codec
    assert (kc.index_bits, kc.vector, kc.smooth, kc.hadamard) == (8, 4, True, True)
    assert (vc.index_bits, vc.smooth, vc.hadamard) == (8, False, False)


# -- bad input -------------------------------------------------------------------------------------


def test_bits_may_be_set_per_side():
    # bits=2 (the default) applies to neither side: 16 index bits with key_vector=8
    c = VecInferCache(key_bits=1, key_vector=8, value_bits=3, value_vector=2)
    kc, vc = c.tiers[0].key_codec, c.tiers[0].value_codec
    assert (kc.bits, kc.vector, kc.index_bits) == (1, 8, 8)
    assert (vc.bits, vc.vector, vc.index_bits) == (3, 2, 6)


def test_head_dims_the_codec_cannot_take():
    k, v = kv_data(t=64, d=100)
    c = VecInferCache(vector=8, bits=1, calibration=32)
    with pytest.raises(ValueError, match="must divide the head dim 100"):
        c.update_and_fetch(k, v)
    assert c.offset == 0 and c.empty()
    k, v = kv_data(t=64, d=81)
    with pytest.raises(ValueError, match="even head dim"):
        VecInferCache(vector=1, bits=4, calibration=32).update_and_fetch(k, v)
    # 81 channels without the Hadamard transform are fine
    c = VecInferCache(vector=1, bits=4, hadamard=False, calibration=32)
    c.update_and_fetch(k, v)
    assert c.calibrated and rel_error(c.keys_and_values()[0], k) < 0.2


def test_too_few_calibration_sub_vectors():
    k, v = kv_data(t=16, d=32)
    c = VecInferCache(bits=2, calibration=4)  # 4 tokens x 8 sub-vectors < 256 codewords
    with pytest.raises(ValueError, match="raise calibration to at least 32"):
        c.update_and_fetch(k, v)
    assert c.offset == 0
    VecInferCache(bits=2, calibration=32).update_and_fetch(k, v)  # 32 x 8 = 256: enough
    with pytest.raises(ValueError, match="cannot be fitted on 2 tokens"):
        VecInfer(bits=2).encode(k[:, :, :2])
    codec = VecInfer(bits=2)
    codec.fit(kv_data(t=40, d=32)[0])
    with pytest.raises(ValueError, match="head dim 32, got 64"):
        codec.encode(kv_data(t=4, d=64)[0])
    with pytest.raises(ValueError, match="batch, heads"):
        codec.encode(kv_data(b=2, t=4, d=32)[0])


@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float32])
def test_coded_tokens_in_other_dtypes(dtype):
    k, v = kv_data(t=48, dtype=dtype)
    c = VecInferCache(bits=4, vector=2, calibration=8)
    kk, vv = c.update_and_fetch(k, v)
    assert kk.dtype == vv.dtype == dtype and c.calibrated
    assert rel_error(vv, v) < 0.15
    q = mx.random.normal((1, 4, 1, 128)).astype(dtype)
    assert c.attend(q, scale=0.1).dtype == dtype
