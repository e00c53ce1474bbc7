"""KVarN: the conformance suite, and what is KVarN's own (its rotation, normalization, codes,
bytes and settings). The normalization is checked against numpy in test_normalize.py."""

import mlx.core as mx
import numpy as np
import pytest

from velox_core import make
from velox_core.ops import unpack
from velox_kvarn import HadamardRotation, KVarNCache, KVarNKeys, KVarNValues
from velox_testing import (
    CacheConformance,
    assert_exact_ends,
    assert_reloads_alike,
    assert_tampered_state_refused,
    kv_data,
    rel_error,
)
from velox_testing.kv import assert_codes_head_dims, assert_scores_and_mix_decoded
from velox_testing.refusals import int_refusals, spec_refusals_test


class TestKVarNHeadline(CacheConformance):
    spec = "kvarn:key_bits=4,value_bits=2"  # the paper's headline: 4-bit keys, 2-bit values
    precise_spec = "kvarn:bits=8"

    # 4.375 / 2.375 bits a key / value entry, 128 fp16 sinks at 2,048 tokens: measured 0.260
    max_memory_ratio = 0.27
    # measured 0.29 (the 2-bit values carry most of it); on the same data and query
    # kivi:key_bits=4,value_bits=2,group=128,window=0 measures 0.38, turboquant at 4/2 bits 0.42
    attention_error = 0.35
    same_greedy_tokens = 32

    bad_settings = int_refusals(iters=(0, 64), group=(2, None), seed=(0, None), value_bits=(2, 8))


class TestKVarN2BitSmallTiles(CacheConformance):
    """2-bit codes in tiles of 64 tokens, no sinks, a 32-token window, a seeded rotation:
    codes from the first updates on, and a rotation kept in the codecs' state."""

    spec = "kvarn:bits=2,group=64,sinks=0,window=32,seed=3"
    precise_spec = "kvarn:bits=8,group=64,sinks=0,window=32,seed=3"

    # 2 + 0.625 bits an entry (2 D + G fp16 a tile of G = 64), a 32-95 token fp16 window:
    # measured 0.192
    max_memory_ratio = 0.2
    # 2-bit keys move kv_data's peaked logits a lot (one query a check: noisy): measured 0.52
    # in test_attention_error and 0.76 in test_trim, against 0.50 and 1.04 for
    # kivi:bits=2,group=64,window=32 (whose own 2-bit suite is bound at 0.9)
    attention_error = 0.9


# -- the rotation ---------------------------------------------------------------------------------
def sylvester(n: int) -> np.ndarray:
    h = np.ones((1, 1))
    while h.shape[0] < n:
        h = np.block([[h, h], [h, -h]])
    return h / np.sqrt(n)


@pytest.mark.parametrize("dim,block", [(128, 128), (64, 64), (80, 16), (96, 32)])
def test_rotation_is_the_sylvester_hadamard_by_blocks(dim, block):
    rot = HadamardRotation(dim)
    x = np.random.default_rng(dim).normal(size=(3, dim)).astype(np.float32)
    want = np.kron(np.eye(dim // block), sylvester(block))  # block-diagonal where not 2^k
    np.testing.assert_allclose(np.array(rot.forward(mx.array(x))), x @ want.T, atol=1e-5)
    np.testing.assert_allclose(np.array(rot.inverse(rot.forward(mx.array(x)))), x, atol=1e-5)
    assert rot.arrays() == {}  # nothing resident: the transform computes it


def test_seeded_rotation_is_kept_in_state_and_checked_on_load():
    c = make("kvarn:bits=4,group=32,sinks=0,seed=7")
    k, v = kv_data(t=64)
    c.update_and_fetch(k, v)
    key = c.tiers[0].key_codec
    assert set(key.state()) == {"rot.signs"} and key.state_nbytes == 128 * 4
    assert make("kvarn:bits=4,group=32,sinks=0").tiers[0].key_codec.state() == {}
    assert_tampered_state_refused(c, "codec.tier0.k.rot.signs", "saved rotation does not match")


# -- the codes ------------------------------------------------------------------------------------
def test_scores_and_mix_from_the_codes_equal_the_decoded_tokens():
    """Both paths: MLX's layout (head dim 128) and the unpacked codes (head dim 80, 7 bits)."""
    for d, bits in ((128, 2), (128, 4), (80, 4), (128, 7)):
        k, v = kv_data(t=256, d=d)
        keys, values = KVarNKeys(bits, group=64), KVarNValues(bits, group=64)
        pk, pv = keys.encode(k), values.encode(v)
        kk, _ = assert_scores_and_mix_decoded(keys, pk, values, pv, seed=d)
        # and the rotated reconstruction is the decoded one, rotated
        assert rel_error(keys.decode_rotated_as(pk, mx.float32), keys.rotation.forward(kk)) < 1e-5


def test_reconstruction_is_the_absorbed_scales_times_the_codes():
    """Keys ``t_t (a_d q + z_d)`` per tile, values ``c_d (b_t q + w_t)``, in the rotated
    domain, from the stored arrays alone (numpy)."""
    k, v = kv_data(t=128, d=64)
    keys, values = KVarNKeys(3, group=64), KVarNValues(3, group=64)
    pk, pv = keys.encode(k), values.encode(v)
    f = lambda a: np.array(a.astype(mx.float32))  # noqa: E731
    qk, qv = f(unpack(pk.data["codes"], 3, 64)), f(unpack(pv.data["codes"], 3, 64))
    assert qk.max() == qv.max() == 7 and qk.min() == qv.min() == 0
    tiles = lambda a: a.reshape(1, 2, 2, 64, -1)  # noqa: E731
    yk = tiles(f(pk.data["tok"])) * (
        tiles(qk) * f(pk.data["scale"])[:, :, :, None] + f(pk.data["zero"])[:, :, :, None]
    )
    yv = f(pv.data["chan"])[:, :, :, None] * (
        tiles(qv) * tiles(f(pv.data["scale"])) + tiles(f(pv.data["zero"]))
    )
    np.testing.assert_allclose(
        yk.reshape(1, 2, 128, 64), f(keys.decode_rotated_as(pk, mx.float32)), rtol=1e-5, atol=1e-5
    )
    np.testing.assert_allclose(
        yv.reshape(1, 2, 128, 64), f(values.decode_rotated_as(pv, mx.float32)), rtol=1e-5, atol=1e-5
    )


# -- bytes ----------------------------------------------------------------------------------------
def test_bytes_of_a_known_input_are_the_codes_and_the_tile_scales():
    """2 heads, 1,000 tokens, head dim 128, 4-bit keys and 2-bit values in tiles of 128: 128
    fp16 sinks, 6 tiles coded (768 tokens), 104 tokens of the 7th tile waiting in fp16."""
    k, v = kv_data(b=1, h=2, t=1000, d=128)
    c = KVarNCache(key_bits=4, value_bits=2)
    c.update_and_fetch(k, v)
    assert [s.tokens for s in c.segments()] == [128, 768, 104]
    tiles, heads = 6, 2
    keys = tiles * heads * (128 * 128 * 4 // 8 + 2 * (2 * 128 + 128))  # codes, tok+scale+zero
    values = tiles * heads * (128 * 128 * 2 // 8 + 2 * (128 + 2 * 128))  # codes, chan+scale+zero
    fp16 = (128 + 104) * heads * 128 * 2 * 2
    assert keys == 6 * 2 * 8960 and values == 6 * 2 * 4864  # the authors' tile records
    assert c.logical_nbytes == keys + values + fp16 == 403_456
    # per coded entry: 4 + 0.375 and 2 + 0.375 bits
    body = c.segments()[1]
    assert body.keys.nbytes * 8 / (heads * 768 * 128) == 4.375
    assert body.values.nbytes * 8 / (heads * 768 * 128) == 2.375


# -- fp16 sinks and the tile being filled ---------------------------------------------------------
def test_sinks_and_the_partial_tile_stay_fp16():
    c = make("kvarn:key_bits=4,value_bits=2,sinks=16,group=64")
    sinks, body, win = assert_exact_ends(c, body_error=0.15)
    # the codes take whole tiles, lcm(flush=64, group=64) tokens at a time: 0-63 wait in fp16
    assert (sinks.tokens, body.tokens, win.tokens) == (16, 640, 44)


def test_window_keeps_more_fp16_tokens():
    k, v = kv_data(t=400)
    c = make("kvarn:bits=4,sinks=0,window=100")
    c.update_and_fetch(k, v)
    assert [s.tokens for s in c.segments()] == [256, 144]  # 100 to 227 newest in fp16


# -- save / load ----------------------------------------------------------------------------------
def test_save_load_keeps_the_codes_and_scales(tmp_path):
    c = make("kvarn:key_bits=4,value_bits=2,seed=2")
    d = assert_reloads_alike(c, tmp_path / "k.safetensors")
    assert isinstance(d, KVarNCache)
    assert set(c.segments()[1].keys.data) == {"codes", "tok", "scale", "zero"}
    assert set(c.segments()[1].values.data) == {"codes", "scale", "zero", "chan"}
    assert mx.array_equal(c.keys_and_values()[0], d.keys_and_values()[0]).item()


# -- settings -------------------------------------------------------------------------------------
def test_codecs_follow_the_settings():
    c = KVarNCache(bits=3, value_bits=2, group=64, iters=4, seed=1)
    t = c.tiers[0]
    assert isinstance(t.key_codec, KVarNKeys) and isinstance(t.value_codec, KVarNValues)
    assert (t.key_codec.bits, t.value_codec.bits) == (3, 2)
    for codec in (t.key_codec, t.value_codec):
        assert (codec.group, codec.iters, codec.seed, codec.block) == (64, 4, 1, 64)
    assert (c.sinks, c.window) == (128, 0)


def test_iterations_change_the_codes():
    """``iters`` is honoured: on keys whose tokens span a 15x range of magnitudes, 0
    iterations (rotation and rounding only) lose more than 1 or 8 (measured 0.45, 0.39,
    0.39), and 1 and 8 give other codes."""
    k, _ = kv_data(t=256)
    k = k * mx.array(np.linspace(0.2, 3.0, 256, dtype=np.float32))[:, None].astype(mx.float16)
    packed = {i: KVarNKeys(2, iters=i).encode(k) for i in (0, 1, 8)}
    errs = {i: rel_error(KVarNKeys(2).decode(p), k) for i, p in packed.items()}
    assert errs[0] > 1.1 * max(errs[1], errs[8]), errs
    assert not mx.array_equal(packed[1].data["tok"], packed[8].data["tok"]).item()


BAD = (
    ("kvarn:iters=-1", r"iters must be >= 0"),
    ("kvarn:iters=100", r"iters must be <= 64"),
    ("kvarn:group=1", r"group must be >= 2"),
    ("kvarn:group=0", r"group must be >= 2"),
    ("kvarn:bits=1", r"bits must be >= 2"),
    ("kvarn:key_bits=9", r"key_bits must be <= 8"),
    ("kvarn:value_bits=1", r"value_bits must be >= 2"),
    ("kvarn:sinks=-1", r"sinks must be >= 0"),
    ("kvarn:window=-2", r"window must be >= 0"),
    ("kvarn:seed=-1", r"seed must be >= 0"),
    ("kvarn:tile=64", r"has no parameter 'tile'"),
)


test_make_cache_refuses_bad_parameters_naming_them = spec_refusals_test(BAD)


def test_odd_head_dims_are_refused_and_even_ones_code():
    cache = KVarNCache()
    with pytest.raises(ValueError, match=r"kvarn: key head dim 81 is odd"):
        cache.check_dims(81, 128)
    with pytest.raises(ValueError, match=r"kvarn: value head dim 63 is odd"):
        cache.check_dims(64, 63)
    assert_codes_head_dims("kvarn:bits=4,sinks=0", 0.1)
