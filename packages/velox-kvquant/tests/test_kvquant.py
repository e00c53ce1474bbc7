"""KVQuant: the conformance suite, and what is KVQuant's own."""

import math

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx_lm.models import rope_utils
from mlx_lm.models.cache import QuantizedKVCache

from velox_core import make, make_cache
from velox_kvquant import (
    METHOD,
    KVQuantCache,
    KVQuantKeys,
    KVQuantValues,
    RopeSpec,
    find_rope,
    rope_spec,
    rotate,
)
from velox_testing import CacheConformance, feed, kv_data, rel_error, tiny_model

BASE = 10000.0


class TestKVQuant4(CacheConformance):
    max_memory_ratio = 0.29  # 4-bit codes, 1 sparse entry per vector, int32 positions, 1 sink
    # kv_data is not RoPE'd: un-rotating it scatters its channel structure (see the test of
    # the 4-bit setting against mlx for RoPE'd keys)
    attention_error = 0.25
    same_greedy_tokens = 32

    bad_settings = (
        {"bits": 1},
        {"value_bits": 1},
        {"outliers": -0.1},
        {"outliers": 0.6},
        {"datatype": "fp4"},
        {"qnorm": 1},
        {"pre_rope": "yes"},
        {"rope_base": "x"},
        {"group": 64},
    )

    def make(self):
        return KVQuantCache(bits=4, rope_base=BASE)

    def make_precise(self):  # no rope_base: make_cache binds the model's RoPE
        return KVQuantCache(bits=8, calibration=32)


class TestKVQuant2(CacheConformance):
    max_memory_ratio = 0.165
    attention_error = 0.75  # 2-bit keys move the peaked logits of kv_data a lot

    def make(self):
        return KVQuantCache(bits=2, qnorm=True, rope_base=BASE)

    def make_precise(self):
        return KVQuantCache(bits=8, calibration=32)


def _roped(k: mx.array, offset: int = 0) -> mx.array:
    return mx.fast.rope(k, k.shape[-1], traditional=False, base=BASE, scale=1.0, offset=offset)


# -- RoPE ----------------------------------------------------------------------------------------
_ROPES = [
    nn.RoPE(64, traditional=False, base=BASE),
    nn.RoPE(64, traditional=True, base=500000.0, scale=0.25),
    nn.RoPE(32, traditional=False, base=BASE),  # partial rotary: 32 of 64 channels
    rope_utils.Llama3RoPE(64, 8192, False, 500000.0, {"factor": 8.0}),
    rope_utils.YarnRoPE(64, traditional=True, scaling_factor=4.0, mscale=1.0),
    rope_utils.SuScaledRoPE(64, short_factor=1.0, long_factor=[1.5] * 32),
    rope_utils.ProportionalRoPE(64, 32, base=BASE),
]


@pytest.mark.parametrize("rope", _ROPES, ids=lambda r: type(r).__name__)
def test_rope_inverse_undoes_the_model_rope(rope):
    x = mx.random.normal((1, 2, 40, 64), key=mx.random.key(0))
    spec = rope_spec(rope)
    for offset in (0, 1000):
        post = rope(x, offset=offset)
        pos = mx.arange(offset, offset + 40).reshape(1, 1, 40)
        # re-rotating equals the model's own RoPE, un-rotating recovers what it was applied to
        # the constant factor of LongRoPE and YaRN commutes with the rotation
        scale = getattr(rope, "_scale", getattr(rope, "mscale", 1.0))
        pre = x.at[..., : spec.dims].multiply(scale) if scale != 1.0 else x
        assert mx.allclose(rotate(pre, pos, spec), post, atol=2e-4)
        assert mx.allclose(rotate(post, pos, spec, inverse=True), pre, atol=2e-4)


def test_pre_rope_round_trip_at_arbitrary_positions():
    x = mx.random.normal((2, 3, 50, 128), key=mx.random.key(1))
    pos = mx.random.randint(0, 100000, (2, 1, 50), key=mx.random.key(2))
    for spec in (RopeSpec.from_base(BASE, 128), RopeSpec.from_base(BASE, 96, traditional=True)):
        back = rotate(rotate(x, pos, spec, inverse=True), pos, spec)
        assert rel_error(back, x) < 1e-5
        assert rel_error(rotate(x, pos, spec), x) > 0.5  # it does rotate


def test_unsupported_rope_and_missing_rope_raise():
    dyn = rope_utils.DynamicNTKScalingRoPE(64, 2048, False, BASE, 2.0)
    with pytest.raises(TypeError, match="DynamicNTK"):
        rope_spec(dyn)
    with pytest.raises(TypeError, match="unsupported RoPE"):
        rope_spec(nn.Linear(4, 4))
    with pytest.raises(ValueError, match="no layer"):
        find_rope(tiny_model("llama"), 7)
    c = KVQuantCache(bits=4)  # standalone, no RoPE known
    k, v = kv_data(t=8)
    with pytest.raises(ValueError, match="RoPE"):
        c.update_and_fetch(k, v)


def test_make_cache_binds_each_model_rope():
    for family, base in (("llama", 10000.0), ("mistral", 1e6)):
        model = tiny_model(family)
        caches = make_cache(model, KVQuantCache(bits=4))
        spec = caches[0].tiers[0].key_codec._rope
        assert spec.same_as(RopeSpec.from_base(base, 64))
        # copies (merge, extract, files) keep the RoPE even before calibration
        assert caches[1].copy().tiers[0].key_codec._rope.same_as(spec)
    with pytest.raises(ValueError, match="disagree"):
        make_cache(tiny_model("mistral"), KVQuantCache(bits=4, rope_base=BASE))


# -- the method's mathematics ----------------------------------------------------------------------
def test_pre_rope_beats_post_rope_on_roped_keys_with_channel_structure():
    """The paper's premise: RoPE smears per-channel structure, so quantize before it."""
    k, v = kv_data(t=512, seed=3)  # channel scales and outlier channels
    post = _roped(k)
    errs = {}
    for pre in (True, False):
        kw = {"rope_base": BASE} if pre else {}
        c = feed(KVQuantCache(bits=3, pre_rope=pre, **kw), post, v, (300, 1, 211))
        errs[pre] = rel_error(c.keys_and_values()[0], post)
    assert errs[True] < 0.85 * errs[False], errs


def test_keys_are_stored_pre_rope_with_their_positions():
    k, v = kv_data(t=200, seed=1)
    c = feed(KVQuantCache(bits=8, rope_base=BASE), _roped(k), v, (150, 50))
    codec, body = c.tiers[0].key_codec, c.segments()[1]
    pos = body.keys.data["pos"]
    assert pos.dtype == mx.int32 and pos.shape == (1, 1, 199)
    assert mx.array_equal(pos[0, 0], mx.arange(1, 200))  # absolute, after the fp16 sink
    # undoing the codec's own RoPE gives the (channel-structured) pre-RoPE keys
    pre = rotate(codec.decode(body.keys), pos, codec._rope, inverse=True)
    assert rel_error(pre, k[:, :, 1:]) < 0.02
    # trimming and refilling keeps positions aligned with offset
    c.trim(30)
    c.update_and_fetch(_roped(k)[:, :, 170:175], v[:, :, 170:175])
    assert mx.array_equal(c.segments()[1].keys.data["pos"][0, 0], mx.arange(1, 175))
    assert rel_error(c.keys_and_values()[0], _roped(k)[:, :, :175]) < 0.02


def test_dense_and_sparse_reduces_error_with_outliers():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(1, 2, 256, 128)).astype(np.float32)
    spikes = rng.random(x.shape) < 0.005  # rare large entries, as in real activations
    x = mx.array(np.where(spikes, 25.0 * np.sign(x), x)).astype(mx.float16)
    for codec_cls, kw in ((KVQuantKeys, {"pre_rope": False}), (KVQuantValues, {})):
        errs = []
        for frac in (0.0, 0.01):
            c = codec_cls(bits=3, outliers=frac, **kw)
            packed = c.encode(x, mx.arange(256))
            errs.append(rel_error(c.decode(packed), x))
            assert ("sparse_val" in packed.data) == (frac > 0)
        assert errs[1] < 0.7 * errs[0], (codec_cls.name, errs)


def test_outliers_are_kept_exactly_in_fp16():
    _, v = kv_data(t=64, seed=2)
    c = KVQuantValues(bits=2, outliers=0.05)  # 6 of 128 per token
    p = c.encode(v)
    assert p.data["sparse_val"].shape == (1, 2, 64, 6) and p.data["sparse_idx"].dtype == mx.uint8
    got = mx.take_along_axis(c.decode(p), p.data["sparse_idx"].astype(mx.int32), axis=-1)
    assert mx.array_equal(got.astype(mx.float16), p.data["sparse_val"])
    exact = mx.take_along_axis(v, p.data["sparse_idx"].astype(mx.int32), axis=-1)
    assert mx.array_equal(exact, p.data["sparse_val"])
    # the per-token rule: they are the entries farthest from the token's median
    dev = mx.abs(v.astype(mx.float32) - mx.median(v.astype(mx.float32), axis=-1, keepdims=True))
    kth = mx.sort(dev, axis=-1)[..., -6]
    assert mx.all(mx.min(mx.abs(exact - mx.median(v, -1, keepdims=True)), -1) >= kth - 1e-3)


def test_nuq_beats_uniform_levels_on_gaussian_data():
    x = mx.random.normal((1, 4, 512, 128), key=mx.random.key(3)).astype(mx.float16)
    for bits in (2, 3, 4):
        errs, codecs = {}, {}
        for dt in ("nuq", "uniform"):
            c = codecs[dt] = KVQuantValues(bits=bits, outliers=0.0, datatype=dt)
            errs[dt] = rel_error(c.decode(c.encode(x)), x)
        assert errs["nuq"] < 0.9 * errs["uniform"], (bits, errs)
    levels = np.array(codecs["nuq"].state()["levels"])[0]
    assert levels.shape == (16,) and np.all(np.diff(levels) > 0)
    assert np.diff(levels)[7] < np.diff(levels)[0]  # denser where the data is


def test_qnorm_matches_the_data_moments():
    x = mx.random.normal((1, 2, 512, 128), key=mx.random.key(4))
    c = KVQuantKeys(bits=2, outliers=0.0, pre_rope=False, qnorm=True)
    p = c.encode(x)
    zero, rng = c.state()["zero"][:, :, None], c.state()["range"][:, :, None]
    u = (x - zero) / rng
    w = rng * rng * mx.ones(u.shape)
    uq = (c.decode(p) - zero) / rng
    for f in (lambda a: a, lambda a: (a - mx.sum(w * a) / mx.sum(w)) ** 2):
        assert (
            abs(float(mx.sum(w * f(u)) / mx.sum(w)) - float(mx.sum(w * f(uq)) / mx.sum(w))) < 0.01
        )
    plain = KVQuantKeys(bits=2, outliers=0.0, pre_rope=False)
    plain.encode(x)
    assert float(mx.max(c.state()["levels"])) > float(mx.max(plain.state()["levels"]))


# -- the 4-bit setting against mlx-lm's own 4-bit cache -------------------------------------------
def test_4bit_setting_beats_mlx_q4_within_its_memory():
    """kv_data's keys as a model's pre-RoPE keys: the cache receives them RoPE'd, as in mlx-lm."""
    setting = {**METHOD.recommended[0], "rope_base": BASE}
    assert setting["bits"] == 4
    scale = 1 / math.sqrt(128)
    chunks = (300, 1, 1, 210)
    for seed in range(4):
        k, v = kv_data(t=512, seed=seed)
        k = _roped(k)
        q = mx.random.normal((1, 4, 1, 128), key=mx.random.key(10 + seed)) + k[:, :1, -1:] / 4
        q = q.astype(mx.float16)
        ref = mx.fast.scaled_dot_product_attention(q, k, v, scale=scale)

        def q4(x):
            return mx.dequantize(*mx.quantize(x, group_size=64, bits=4), group_size=64, bits=4)

        mlx_err = rel_error(
            mx.fast.scaled_dot_product_attention(q, q4(k).astype(k.dtype), q4(v), scale=scale), ref
        )
        cache = feed(KVQuantCache(**setting), k, v, chunks)
        mlx_cache = feed(QuantizedKVCache(group_size=64, bits=4), k, v, chunks)
        mx.eval(cache.state, mlx_cache.state)
        assert cache.nbytes <= mlx_cache.nbytes, (cache.nbytes, mlx_cache.nbytes)
        assert rel_error(cache.attend(q, scale=scale), ref) <= mlx_err, seed


def test_recommended_settings():
    assert [s["bits"] for s in METHOD.recommended] == [4, 3, 2]
    for s in METHOD.recommended:
        c = make("kvquant", **s, rope_base=BASE)
        assert isinstance(c, KVQuantCache) and c.tiers[0].key_codec.bits == s["bits"]


# -- the cache's behaviour -------------------------------------------------------------------------
def _bytes_per_token(bits: int, d: int, heads: int, k: int) -> float:
    """Resident bytes of one token of one head, from the Packed layout."""
    words = 4 * math.ceil(d * bits / 32)
    keys = words + 3 * k + 4 / heads  # codes, fp16 value + uint8 index per outlier, int32 pos
    values = words + 4 + 3 * k  # codes, fp16 zero and scale, outliers
    return keys + values


@pytest.mark.parametrize("bits", [2, 3, 4])
def test_memory_follows_the_packed_layout(bits):
    k, v = kv_data(t=513, h=4)
    c = KVQuantCache(bits=bits, rope_base=BASE)
    c.update_and_fetch(k, v)  # 1 sink + 512 coded tokens
    mx.eval(c.state)
    state = sum(cd.state_nbytes for cd in c._codecs())
    sink = 2 * 4 * 128 * 2
    assert c.nbytes == 512 * 4 * _bytes_per_token(bits, 128, 4, 1) + sink + state
    assert state < 3 * 4 * 128 * 2 + 2 * 4 * 256  # zero/range per channel, levels, RoPE


def test_first_token_and_calibration_tokens_wait_in_fp16():
    k, v = kv_data(t=200, seed=4)
    c = KVQuantCache(bits=2, calibration=64, rope_base=BASE)
    c.update_and_fetch(k[:, :, :40], v[:, :, :40])
    assert not c.calibrated
    state = c.tiers[0].key_codec.state()
    assert set(state) == {"rope_theta", "rope_layout"}  # nothing fitted yet
    # the window's buffer grows 16 tokens at a time: the 40 tokens are its logical bytes
    assert c.logical_nbytes == 40 * 2 * 128 * 2 * 2 + sum(a.nbytes for a in state.values())
    kk, vv = c.keys_and_values()
    assert mx.array_equal(kk, k[:, :, :40]) and mx.array_equal(vv, v[:, :, :40])
    for i in range(40, 65):
        c.update_and_fetch(k[:, :, i : i + 1], v[:, :, i : i + 1])
    assert c.calibrated
    sink, body = c.segments()
    assert sink.tokens == 1 and body.tokens == 64
    kk, vv = c.keys_and_values()
    assert mx.array_equal(kk[:, :, :1], k[:, :, :1]) and mx.array_equal(vv[:, :, :1], v[:, :, :1])
    assert rel_error(kk[:, :, 1:], k[:, :, 1:65]) > 0  # the rest is coded


def test_datatype_is_fitted_per_layer_and_per_sequence():
    k1, v1 = kv_data(t=160, seed=5)
    k2, v2 = kv_data(t=160, seed=6)
    k2, v2 = 3 * k2, v2 * v2  # a second sequence with other statistics
    batched = KVQuantCache(bits=3, rope_base=BASE)
    batched.update_and_fetch(mx.concatenate([k1, k2]), mx.concatenate([v1, v2]))
    vlevels = batched.tiers[0].value_codec.state()["levels"]
    assert vlevels.shape == (2, 8) and not mx.allclose(vlevels[0], vlevels[1])
    single = KVQuantCache(bits=3, rope_base=BASE)
    single.update_and_fetch(k2, v2)
    for name, a in single.tiers[0].key_codec.state().items():
        assert mx.array_equal(a, batched.tiers[0].key_codec.state()[name][-a.shape[0] :]), name
    one = batched.extract(1)
    assert mx.array_equal(one.keys_and_values()[0], single.keys_and_values()[0])
    merged = KVQuantCache.stack([single, single])
    assert merged.tiers[0].key_codec.state()["zero"].shape[0] == 2
    fresh = KVQuantCache(bits=3, rope_base=BASE)
    fresh.update_and_fetch(k2[:, :, :10], v2[:, :, :10])
    with pytest.raises(ValueError, match="calibrated"):
        KVQuantCache.stack([single, fresh])


def test_saved_model_cache_keeps_its_rope(tmp_path):
    from velox_core import load_cache, routed, save_cache

    model = tiny_model("mistral")
    caches = make_cache(model, KVQuantCache(bits=4, calibration=16))
    with routed(model):
        model(mx.random.randint(0, 512, (1, 30), key=mx.random.key(0)), cache=caches)
    save_cache(tmp_path / "c.safetensors", caches)
    loaded = load_cache(tmp_path / "c.safetensors")
    a, b = caches[0].tiers[0].key_codec, loaded[0].tiers[0].key_codec
    assert b._rope.same_as(a._rope) and not b._rope.same_as(RopeSpec.from_base(BASE, 64))
    assert mx.array_equal(loaded[0].keys_and_values()[0], caches[0].keys_and_values()[0])


@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float32])
def test_coded_tokens_in_other_dtypes(dtype):
    k, v = kv_data(t=48, dtype=dtype)
    c = KVQuantCache(bits=4, calibration=8, rope_base=BASE)
    kk, vv = c.update_and_fetch(k, v)
    assert kk.dtype == vv.dtype == dtype and c.calibrated
    body = c.segments()[1]
    assert body.keys.data["sparse_val"].dtype == (
        mx.bfloat16 if dtype == mx.bfloat16 else mx.float16
    )
    assert rel_error(vv, v) < 0.15
    q = mx.random.normal((1, 4, 1, 128)).astype(dtype)
    assert c.attend(q, scale=0.1).dtype == dtype
