"""KIVI: the conformance suite, and what is KIVI's own."""

import mlx.core as mx

from velox_core import Uniform, make
from velox_kivi import KIVICache
from velox_testing import CacheConformance, assert_head_dim_refused, kv_data, rel_error


class TestKIVI4(CacheConformance):
    spec = "kivi:bits=4"
    precise_spec = "kivi:bits=8"

    max_memory_ratio = 0.38  # 4-bit codes, fp16 scale/zero per 32, a 128-token fp16 window
    attention_error = 0.1
    same_greedy_tokens = 32

    bad_settings = ({"bits": 1},)


class TestKIVI2(CacheConformance):
    spec = "kivi:bits=2,group=32,window=32"
    precise_spec = "kivi:bits=8,group=32,window=32"

    max_memory_ratio = 0.27
    attention_error = 0.9  # 2-bit keys move the peaked logits of kv_data a lot


def test_codecs_follow_the_paper():
    c = KIVICache(bits=2, group=32, window=128)
    t = c.tiers[0]
    assert isinstance(t.key_codec, Uniform) and t.key_codec.axis == "channel"
    assert isinstance(t.value_codec, Uniform) and t.value_codec.axis == "token"
    assert t.key_codec.bits == t.value_codec.bits == 2 and c.window == 128


def test_per_channel_keys_beat_per_token_keys_on_outlier_channels():
    """KIVI's premise: key outliers live in channels, so per-channel groups lose less."""
    k, v = kv_data(t=512)
    kivi, tok = KIVICache(bits=2, window=0), make("uniform:bits=2,group=32")
    kivi.update_and_fetch(k, v)
    tok.update_and_fetch(k, v)
    assert rel_error(kivi.keys_and_values()[0], k) < 0.8 * rel_error(tok.keys_and_values()[0], k)


def test_residual_window_stays_fp16_and_is_quantized_as_it_fills():
    k, v = kv_data(t=300)
    c = KIVICache(bits=2, group=32, window=128)
    for i in range(300):
        c.update_and_fetch(k[:, :, i : i + 1], v[:, :, i : i + 1])
    body, win = c.segments()
    # keys leave the window a flush quantum at a time (64 tokens: whole groups of 32)
    assert 128 <= win.tokens < 128 + 64 and body.tokens % 64 == 0
    assert body.tokens + win.tokens == 300
    kk, vv = c.keys_and_values()
    assert mx.array_equal(kk[:, :, -128:], k[:, :, -128:])
    assert mx.array_equal(vv[:, :, -128:], v[:, :, -128:])


def test_separate_key_and_value_bits():
    c = KIVICache(bits=4, key_bits=2)
    assert c.tiers[0].key_codec.bits == 2 and c.tiers[0].value_codec.bits == 4


def test_make_cache_refuses_a_head_dim_naming_kivi_and_its_parameter():
    assert_head_dim_refused("kivi", "group=32 must divide the value head dim 80", "kivi:group=16")
