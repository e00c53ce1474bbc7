"""SKVQ: the conformance suite, and what is SKVQ's own."""

import json

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import QuantizedKVCache

from velox_core import make
from velox_skvq import METHOD, SKVQ, SKVQCache
from velox_skvq.quant import pack_codes, unpack_codes
from velox_testing import (
    CacheConformance,
    assert_head_dim_refused,
    attention_errors_vs_mlx_quant,
    fill_chunks,
    kv_data,
    rel_error,
)

FOUR_BIT = METHOD.recommended[0]
HEADLINE = METHOD.recommended[3]


class TestSKVQ4(CacheConformance):
    max_memory_ratio = 0.28  # 4-bit codes, fp16 scale+zero per 64 (keys) / 128 (values)
    attention_error = 0.25  # no fp16 window: the recent tokens kv_data's query favours are coded
    same_greedy_tokens = 32

    bad_settings = (
        {"bits": 1},
        {"bits": 1.7},
        {"value_bits": "2"},
        {"key_group": 0},
        {"clip_min": 0.3},
        {"clip_min": 1.2},
        {"reorder": "yes"},
        {"sinks": -2},
    )

    def make(self):
        return SKVQCache(**FOUR_BIT)

    def make_precise(self):
        return SKVQCache(**{**FOUR_BIT, "bits": 8})


class TestSKVQHeadline(CacheConformance):
    max_memory_ratio = 0.21  # 2-bit keys, 1.6-bit values, 133 fp16 tokens of 2,048
    attention_error = 0.9  # 2-bit keys move the peaked logits of kv_data a lot

    def make(self):
        return SKVQCache(**HEADLINE)

    def make_precise(self):
        return SKVQCache(**{**HEADLINE, "key_bits": 8, "value_bits": 8})


def _coded(codec, x):
    """Reconstruction of ``x`` by a codec fitted on ``x`` itself."""
    return codec.decode(codec.encode(x))


# -- reordering ------------------------------------------------------------------------------
@pytest.mark.parametrize("group", [32, 64])
def test_reordering_reduces_key_error_on_outlier_channels(group):
    k, _ = kv_data(t=512)
    plain = rel_error(_coded(SKVQ(2, group, clip_min=1.0, reorder=False), k), k)
    reordered = rel_error(_coded(SKVQ(2, group, clip_min=1.0), k), k)
    assert reordered < 0.9 * plain, (reordered, plain)


def test_reordering_groups_outlier_channels_across_heads():
    """kv_data's 4 outlier channels per head (8 of the layer's 256) end up in one group."""
    k, _ = kv_data(t=512)
    c = SKVQ(4, 32)
    c.fit(k)
    perm = np.array(c.perm[0]).astype(np.int64)
    assert sorted(perm.tolist()) == list(range(256))
    flat = np.array(mx.swapaxes(k.astype(mx.float32), 1, 2).reshape(-1, 256))
    widest = np.argsort(flat.max(0) - flat.min(0))[-8:]
    slot = np.argsort(perm)  # slot of each channel
    assert len({int(s) // 32 for s in slot[widest]}) == 1
    assert {int(p) // 128 for p in perm[slot[widest[0]] // 32 * 32 :][:32]} == {0, 1}


# -- clipping --------------------------------------------------------------------------------
def _datasets():
    rng = np.random.default_rng(0)
    k, _ = kv_data(t=256)
    uniform = rng.uniform(-1, 1, size=(1, 2, 256, 128))
    laplace = rng.laplace(0, 1, size=(1, 2, 256, 128))
    return {"kv_data": k, "uniform": uniform, "laplace": laplace}


@pytest.mark.parametrize("bits", [4, 3, 2, 1.5])
@pytest.mark.parametrize("name", ["kv_data", "uniform", "laplace"])
def test_clip_search_never_worse_than_no_clipping(bits, name):
    x = mx.array(_datasets()[name]).astype(mx.float16)
    clipped = rel_error(_coded(SKVQ(bits, 64), x), x)
    unclipped = rel_error(_coded(SKVQ(bits, 64, clip_min=1.0), x), x)
    assert clipped <= unclipped * (1 + 1e-6), (clipped, unclipped)


def test_clip_search_keeps_the_full_range_when_it_is_exact():
    """Values on the 2-bit grid of their own min and max: clipping can only hurt."""
    rng = np.random.default_rng(2)
    x = rng.choice([-1.0, -1 / 3, 1 / 3, 1.0], size=(1, 2, 64, 128))
    x[..., ::32] = -1.0  # every group of every token reaches both ends
    x[..., 1::32] = 1.0
    c = SKVQ(2, 32, reorder=False)
    x = mx.array(x).astype(mx.float16)
    c.fit(x)
    assert np.all(np.array(c.clip.astype(mx.float32)) == 1.0)
    assert rel_error(_coded(c, x), x) < 1e-3


@pytest.mark.parametrize("bits", [2, 3])
def test_clip_search_clips_keys_with_outliers(bits):
    """kv_data's keys (outlier channels, wide per-token ranges) are clipped, within the grid,
    and clipping lowers their error below the unclipped codes'."""
    k, _ = kv_data(t=256)
    c = SKVQ(bits, 64)
    c.fit(k)
    clip = np.array(c.clip.astype(mx.float32))
    assert clip.mean() < 0.95 and clip.min() >= 0.7 - 1e-3
    unclipped = rel_error(_coded(SKVQ(bits, 64, clip_min=1.0), k), k)
    assert rel_error(_coded(c, k), k) < 0.97 * unclipped


# -- codes and attention from them ------------------------------------------------------------
def test_ternary_codes_pack_five_to_a_byte():
    codes = mx.array(np.random.default_rng(1).integers(0, 3, size=(2, 3, 7, 128)), dtype=mx.uint8)
    packed = pack_codes(codes, 1.5)
    assert packed.dtype == mx.uint8 and packed.shape == (2, 3, 7, 26)  # ceil(128 / 5)
    assert mx.array_equal(unpack_codes(packed, 1.5, 128), codes)
    k, _ = kv_data(t=64)
    c = SKVQ(1.5, 64)
    p = c.encode(k)
    assert p.data["codes"].nbytes == 64 * 2 * 26
    kk = np.array(c._reordered(p).reshape(1, 2, 64, 2, 64))
    assert max(len(np.unique(g)) for g in kk.reshape(-1, 64)) <= 3  # three levels per group


@pytest.mark.parametrize(
    "bits,group,reorder", [(4, 64, True), (3, 128, True), (2, 32, False), (1.5, 64, True)]
)
def test_compressed_scores_and_mix_equal_decoded(bits, group, reorder):
    k, _ = kv_data(h=4, t=96)
    c = SKVQ(bits, group, reorder=reorder)
    p = c.encode(k)
    kh = c.decode(p)
    q = mx.random.normal((1, 4, 6, 128), key=mx.random.key(0))
    s = c.scores(q, p)
    assert rel_error(s, q @ mx.swapaxes(kh, -1, -2)) < 1e-5
    w = mx.softmax(s, axis=-1)
    assert rel_error(c.mix(w, p), w @ kh) < 1e-5
    if reorder:  # the stored chunks mix heads: the query really is spread over them
        owner = np.array(c.perm).reshape(1, 4, 128) // 128
        assert max(len(np.unique(chunk)) for chunk in owner[0]) > 1


# -- window, sinks and calibration -------------------------------------------------------------
def test_window_and_sinks_stay_exact():
    k, v = kv_data(t=300)
    c = SKVQCache(**{**HEADLINE, "window": 64})
    for i in range(300):
        c.update_and_fetch(k[:, :, i : i + 1], v[:, :, i : i + 1])
    sinks, body, win = c.segments()
    assert (sinks.tokens, body.tokens, win.tokens) == (5, 231, 64)
    kk, vv = c.keys_and_values()
    for a, b in ((kk, k), (vv, v)):
        assert mx.array_equal(a[:, :, :5], b[:, :, :5])
        assert mx.array_equal(a[:, :, -64:], b[:, :, -64:])
        assert not mx.array_equal(a[:, :, 5:-64], b[:, :, 5:-64])


def test_fitted_on_the_first_tokens_but_not_the_sinks():
    k, v = kv_data(t=400, seed=2)
    c = SKVQCache(bits=3, group=64, window=64, sinks=5)
    c.update_and_fetch(k[:, :, :200], v[:, :, :200])
    kc, vc = c.tiers[0].key_codec, c.tiers[0].value_codec
    ref_k, ref_v = SKVQ(3, 64), SKVQ(3, 64)
    ref_k.fit(k[:, :, 5:200])
    ref_v.fit(v[:, :, 5:200])
    for got, ref in ((kc, ref_k), (vc, ref_v)):
        assert mx.array_equal(got.perm, ref.perm) and mx.array_equal(got.clip, ref.clip)
    perm = kc.perm
    c.update_and_fetch(k[:, :, 200:], v[:, :, 200:])  # fitted once: later tokens change nothing
    assert mx.array_equal(kc.perm, perm)


def test_state_is_saved_and_counted():
    k, v = kv_data(t=300)
    c = SKVQCache(**HEADLINE)
    assert c.tiers[0].key_codec.state() == {}
    c.update_and_fetch(k, v)
    st = c.tiers[0].key_codec.state()
    assert st["perm"].shape == (1, 256) and st["perm"].dtype == mx.uint8  # 256 channels
    assert st["clip"].shape == (1, 2, 2)
    stores = sum(s.nbytes for s in c._stores())
    codec_bytes = sum(x.nbytes for cd in c._codecs() for x in cd.state().values())
    assert c.nbytes == stores + codec_bytes and codec_bytes > 0
    saved = json.loads(c.state[0])["arrays"]
    assert {"codec.tier0.k.perm", "codec.tier0.k.clip", "codec.tier0.v.perm"} <= set(saved)
    assert c.fresh().tiers[0].key_codec.state() == {}


def test_batch_rows_are_fitted_apart_and_follow_filter_and_extend():
    k, v = kv_data(b=2, t=200)
    k = mx.concatenate([k[:1], k[1:] * mx.linspace(0.2, 3, 128)], axis=0)  # rows differ
    c = SKVQCache(bits=4, group=32, window=16, sinks=0)
    c.update_and_fetch(k, v)
    perms = c.tiers[0].key_codec.perm
    assert not mx.array_equal(perms[0], perms[1])
    one = c.extract(1)
    assert mx.array_equal(one.tiers[0].key_codec.perm, perms[1:])
    both = SKVQCache.stack([c.extract(0), one])
    assert mx.array_equal(both.tiers[0].key_codec.perm, perms)
    q = mx.random.normal((2, 4, 1, 128)).astype(mx.float16)
    assert mx.array_equal(both.attend(q, scale=0.1), c.attend(q, scale=0.1))
    short = SKVQCache(bits=4, group=32, window=16, sinks=0)
    short.update_and_fetch(k[:1, :, :10], v[:1, :, :10])  # nothing coded, nothing fitted
    with pytest.raises(ValueError):
        c.extract(0).extend(short)


# -- the 4-bit setting against mlx's own 4-bit quantization ------------------------------------
def test_four_bit_setting_beats_mlx_q4_in_error_and_bytes():
    t = 2048
    for seed in (0, 1):
        k, v = kv_data(t=t, seed=seed)
        mq = QuantizedKVCache(group_size=64, bits=4)
        c = SKVQCache(**FOUR_BIT)
        fill_chunks([mq, c], k, v)
        assert c.nbytes <= mq.nbytes, (c.nbytes, mq.nbytes)
        ours, theirs = attention_errors_vs_mlx_quant(c, k, v, seed=seed, stride=200)
        assert ours <= theirs, (seed, ours, theirs)


# -- settings ---------------------------------------------------------------------------------
def test_spec_and_separate_settings():
    c = make("skvq:key_bits=2,value_bits=1.5,key_group=32,window=16")
    kc, vc = c.tiers[0].key_codec, c.tiers[0].value_codec
    assert (kc.bits, vc.bits, kc.group, vc.group, c.window, c.sinks) == (2, 1.5, 32, 64, 16, 5)
    assert type(c).from_config(c.config()).config() == c.config()


def test_group_must_divide_the_head_dim():
    k, v = kv_data(t=8, d=96)
    with pytest.raises(ValueError, match="group"):
        SKVQCache(group=64, window=0, sinks=0).update_and_fetch(k, v)


def test_make_cache_refuses_a_head_dim_naming_skvq_and_its_parameter():
    assert_head_dim_refused("skvq", "group=64 must divide the key head dim 80", "skvq:group=16")
