"""xKV: the conformance suite, the cross-layer group through make_cache, and xKV's mathematics."""

import copy
import math

import mlx.core as mx
import numpy as np
import pytest

from velox_core import Packed, load_cache, make, make_cache, routed, save_cache
from velox_testing import (
    CacheConformance,
    assert_linked_copies,
    conformance_model,
    kv_data,
    rel_error,
)
from velox_xkv import LatentKeys, LatentValues, RopeSpec, XKVCache, XKVGroup, rotate

BASE = 10000.0  # the tiny llama's rope_theta
SPEC = RopeSpec.from_base(BASE, 128)


class TestXKV(CacheConformance):
    # Alone a cache is a group of one (the paper's single-layer SVD) of kv_data's synthetic
    # tokens, which are full rank (2 heads x 128 = 256 features): rank 128 of 256 keeps about
    # half of the values' energy, hence the loose attention bound. The model-level checks run
    # through make_cache over the tiny 2-layer llama, whose two layers form one group.
    max_memory_ratio = 0.57  # 128 + 128 latent channels for 2 x 2 x 128 fp16 ones, plus B_l
    attention_error = 0.6
    same_greedy_tokens = 32  # make_precise keeps every rank of the group (512 features)

    bad_settings = (
        {"layer_group": 0},
        {"key_rank": 0},
        {"value_rank": -2},
        {"key_rank": 1.5},
        {"pre_rope": "yes"},
        {"flush": 4},
        {"rope_dims": 64},
        {"rope_base": BASE, "rope_dims": 3},
    )

    def make(self):
        return XKVCache(key_rank=128, value_rank=128, rope_base=BASE)

    def make_precise(self):
        return XKVCache(key_rank=512, value_rank=512)

    def test_batch_generate_ragged(self):
        """mlx-lm batches sequences by merging each layer's caches alone, which cannot keep a
        latent shared across layers: a cross-layer group refuses it clearly; groups of one
        layer (layer_group=1) batch like any velox cache (the suite's check)."""
        model = conformance_model()
        caches = make_cache(model, self.make())
        assert caches[0].group is caches[1].group
        with pytest.raises(ValueError, match="cross-layer group"):
            caches[0].merge([caches[0]])
        self.make = lambda: XKVCache(layer_group=1, key_rank=128, value_rank=128, rope_base=BASE)
        super().test_batch_generate_ragged()


# -- helpers ---------------------------------------------------------------------------------------
def _model(layers=2):
    return conformance_model(num_hidden_layers=layers)


def _low_rank(t, layers, rank, seed=0, h=2, d=128):
    """Pre-RoPE keys of ``layers`` layers sharing one rank-``rank`` token latent: ``(B, H, T,
    D)`` float16 per layer (a shared ``A``, a layer's own ``B_l``)."""
    rng = np.random.default_rng(seed)
    a = rng.normal(size=(t, rank))
    out = []
    for _ in range(layers):
        b = rng.normal(size=(rank, h * d)) * 0.3
        x = (a @ b).reshape(1, t, h, d).transpose(0, 2, 1, 3)
        out.append(mx.array(x.astype(np.float32)).astype(mx.float16))
    return out


def _group(n, **kw):
    caches = [XKVCache(rope_base=BASE, **kw) for _ in range(n)]
    XKVGroup(caches)
    for i, c in enumerate(caches):
        c.layer = i
    return caches


def _pre(c):
    """A cache's keys rebuilt before RoPE (float32), from its latent and window."""
    k, _ = c.keys_and_values()
    return rotate(k, 0, SPEC, inverse=True)


# -- the group ------------------------------------------------------------------------------------
def test_make_cache_groups_adjacent_layers():
    caches = make_cache(_model(5), "xkv:layer_group=2")
    groups = [c.group for c in caches]
    assert groups[0] is groups[1] and groups[2] is groups[3]
    assert len({id(g) for g in groups}) == 3 and groups[4].members == [caches[4]]
    assert [c.layer for c in groups[2].members] == [2, 3]
    # each make_cache call makes new groups
    again = make_cache(_model(5), "xkv:layer_group=2")
    assert again[0].group is not groups[0]


def test_earlier_layers_hold_fp16_until_the_last_layer_of_the_group_has_the_chunk():
    c0, c1 = _group(2, key_rank=64, value_rank=64)
    k, v = kv_data(t=120)
    c0.update_and_fetch(k, v)
    assert c0._lat == 0 and c0.stored.window[0].tokens == 120 and c0.group.tokens == 0
    fp16_window = c0.nbytes
    assert fp16_window >= 2 * 120 * 2 * 128 * 2  # keys and values, fp16
    c1.update_and_fetch(k * 0.5, v)
    assert c0._lat == c1._lat == c0.group.tokens == 120
    assert c0.stored.window[0].tokens == c1.stored.window[0].tokens == 0
    # decode tokens stay fp16 in the window; the next prefill chunk takes them along
    for c in (c0, c1):
        c.update_and_fetch(k[:, :, :1], v[:, :, :1])
        assert c._lat == 120 and c.stored.window[0].tokens == 1
    kk, vv = c0.keys_and_values()
    assert mx.array_equal(kk[:, :, -1:], k[:, :, :1]) and mx.array_equal(vv[:, :, -1:], v[:, :, :1])
    for c in (c0, c1):
        c.update_and_fetch(k[:, :, :40], v[:, :, :40])
    assert c0._lat == c1._lat == 161 and c0.stored.window[0].tokens == 0


def test_bytes_fall_with_the_rank_as_predicted_and_the_latent_counts_once():
    model = _model(3)  # groups [0, 1] and [2]
    prompt = mx.random.randint(0, 512, (1, 300), key=mx.random.key(0))
    totals = {}
    for rk, rv in ((32, 48), (64, 96)):
        spec = f"xkv:layer_group=2,key_rank={rk},value_rank={rv}"
        caches = make_cache(model, spec, storage_dtype=mx.float16)
        with routed(model):
            model(prompt, cache=caches)
        h, d, t = 2, 128, 300
        # per group: T x (rk + rv) fp16 latent once; per layer: H x (rk + rv) x D fp16 B_l
        predicted = 2 * t * (rk + rv) * 2 + 3 * h * (rk + rv) * d * 2
        assert sum(c.nbytes for c in caches) == predicted
        latent = sum(a.nbytes for s in caches[0].group.store for a in s.arrays())
        assert latent == t * (rk + rv) * 2
        assert caches[0].nbytes - caches[1].nbytes == latent  # only the group's first layer
        unique = {
            id(a): a.nbytes for c in caches for s in c.named_stores().values() for a in s.arrays()
        }
        unique.update({id(a): a.nbytes for c in caches for a in (c._kc.basis, c._vc.basis)})
        assert sum(unique.values()) == predicted
        totals[rk] = predicted
    assert totals[64] - totals[32] == 2 * 300 * 80 * 2 + 3 * 2 * 80 * 128 * 2  # 80 more ranks


# -- the mathematics ------------------------------------------------------------------------------
def test_one_latent_of_rank_r_rebuilds_every_layer_of_the_group():
    pre = _low_rank(200, 2, rank=24)
    caches = _group(2, key_rank=24, value_rank=24)
    for c, x in zip(caches, pre):
        c.update_and_fetch(rotate(x, 0, SPEC).astype(mx.float16), x)
    for c, x in zip(caches, pre):
        assert c.group.store[0].view().data["a"].shape == (1, 1, 200, 24)  # one shared latent
        assert rel_error(_pre(c), x) < 5e-3
        assert rel_error(c.keys_and_values()[1], x) < 5e-3


def test_joint_fit_is_the_best_rank_r_approximation_of_the_stacked_layers():
    k0, v0 = kv_data(t=160, seed=1)
    k1, v1 = kv_data(t=160, seed=2)
    caches = _group(2, key_rank=40, value_rank=40)
    for c, k, v in zip(caches, (k0, k1), (v0, v1)):
        c.update_and_fetch(k, v)

    def flat(x):
        return np.array(x.astype(mx.float32)).transpose(0, 2, 1, 3).reshape(160, -1)

    stacked = np.concatenate([flat(rotate(k0, 0, SPEC, True)), flat(rotate(k1, 0, SPEC, True))], 1)
    s = np.linalg.svd(stacked, compute_uv=False)
    best = math.sqrt(np.sum(s[40:] ** 2))  # Eckart-Young: the rank-40 error
    got = np.concatenate([flat(_pre(c)) for c in caches], 1)
    assert np.linalg.norm(got - stacked) == pytest.approx(best, rel=2e-2)
    vs = np.concatenate([flat(v0), flat(v1)], 1)
    sv = np.linalg.svd(vs, compute_uv=False)
    gv = np.concatenate([flat(c.keys_and_values()[1]) for c in caches], 1)
    assert np.linalg.norm(gv - vs) == pytest.approx(math.sqrt(np.sum(sv[40:] ** 2)), rel=2e-2)


def test_a_prefill_in_chunks_is_updated_exactly():
    pre = _low_rank(300, 2, rank=20, seed=3)
    caches = _group(2, key_rank=20, value_rank=20)
    for a, b in ((0, 100), (100, 230), (230, 300)):
        for c, x in zip(caches, pre):
            c.update_and_fetch(rotate(x[:, :, a:b], a, SPEC).astype(mx.float16), x[:, :, a:b])
    for c, x in zip(caches, pre):
        assert c._lat == 300 and rel_error(_pre(c), x) < 5e-3
    # on full-rank tokens the chunked fit loses little against the one-shot SVD
    k, v = kv_data(t=300, seed=4)
    whole = XKVCache(key_rank=64, value_rank=64, rope_base=BASE)
    parts = XKVCache(key_rank=64, value_rank=64, rope_base=BASE)
    whole.update_and_fetch(k, v)
    for a, b in ((0, 100), (100, 200), (200, 300)):
        parts.update_and_fetch(k[:, :, a:b], v[:, :, a:b])
    e_whole = rel_error(whole.keys_and_values()[1], v)
    e_parts = rel_error(parts.keys_and_values()[1], v)
    assert e_whole <= e_parts + 1e-3 < 1.15 * e_whole


def test_pre_rope_keys_are_low_rank_where_post_rope_keys_are_not():
    x = _low_rank(256, 1, rank=16, seed=5)[0]
    post = rotate(x, 0, SPEC).astype(mx.float16)
    pre_c = XKVCache(key_rank=16, value_rank=16, rope_base=BASE)
    post_c = XKVCache(key_rank=16, value_rank=16, pre_rope=False)
    for c in (pre_c, post_c):
        c.update_and_fetch(post, x)
    assert rel_error(pre_c.keys_and_values()[0], post) < 5e-3
    assert rel_error(post_c.keys_and_values()[0], post) > 0.1


@pytest.mark.parametrize("pre_rope", [True, False])
def test_scores_and_mix_from_the_latent_equal_the_rebuilt_keys_and_values(pre_rope):
    rng = np.random.default_rng(6)
    a = mx.array(np.linalg.qr(rng.normal(size=(2, 90, 12)))[0].astype(np.float32))[:, None]
    rec = Packed({"a": mx.broadcast_to(a, (2, 3, 90, 12))}, 90)
    keys, values = LatentKeys(pre_rope), LatentValues()
    keys.rope = RopeSpec.from_base(BASE, 64)
    keys.basis = mx.array(rng.normal(size=(2, 3, 12, 64)).astype(np.float32))
    values.basis = mx.array(rng.normal(size=(2, 3, 12, 64)).astype(np.float32))
    q = mx.array(rng.normal(size=(2, 3, 5, 64)).astype(np.float32))
    w = mx.softmax(mx.array(rng.normal(size=(2, 3, 5, 90)).astype(np.float32)), axis=-1)
    k = a @ keys.basis  # (2, 3, 90, 64) pre-RoPE (or post-RoPE) keys, rebuilt by hand
    if pre_rope:
        k = rotate(k, 0, keys.rope)
    assert rel_error(keys.decode(rec), k) < 1e-5
    assert rel_error(keys.scores(q, rec), q @ mx.swapaxes(k, -1, -2)) < 1e-5
    assert rel_error(values.mix(w, rec), w @ (a @ values.basis)) < 1e-5
    assert keys.compressed_scores is (not pre_rope) and values.compressed_mix


@pytest.mark.parametrize("through", ["itself", "deepcopy", "file"])
def test_trim_then_a_new_chunk_keeps_the_factorization_exact(through, tmp_path):
    pre = _low_rank(200, 2, rank=16, seed=7)
    caches = _group(2, key_rank=32, value_rank=32)
    for c, x in zip(caches, pre):
        c.update_and_fetch(rotate(x[:, :, :150], 0, SPEC).astype(mx.float16), x[:, :, :150])
    for c in caches:
        c.trim(30)  # into the latent: its columns are re-orthonormalized at the next fit
    if through == "deepcopy":
        caches = copy.deepcopy(caches)
    elif through == "file":  # a copy or a file keeps that the latent awaits it
        save_cache(tmp_path / "trimmed.safetensors", caches)
        caches = load_cache(tmp_path / "trimmed.safetensors")
    assert caches[0].group.tokens == 120 and caches[0].group.dirty
    for c, x in zip(caches, pre):
        c.update_and_fetch(rotate(x[:, :, 120:200], 120, SPEC).astype(mx.float16), x[:, :, 120:200])
    assert not caches[0].group.dirty
    for c, x in zip(caches, pre):
        assert c.offset == c.size() == 200 and rel_error(_pre(c), x) < 5e-3


# -- files and copies -----------------------------------------------------------------------------
def test_save_load_and_deepcopy_of_the_whole_model_keep_the_groups(tmp_path):
    model = _model(3)  # groups [0, 1] and [2]
    caches = make_cache(model, "xkv:key_rank=64,value_rank=64")
    for other in assert_linked_copies(model, caches, tmp_path / "x.safetensors", "lat"):
        assert other[0].group is other[1].group is not other[2].group


def test_a_layer_saved_without_its_group_is_refused(tmp_path):
    model = _model(2)
    caches = make_cache(model, "xkv:key_rank=64,value_rank=64")
    with routed(model):
        model(mx.random.randint(0, 512, (1, 60), key=mx.random.key(2)), cache=caches)
    save_cache(tmp_path / "one.safetensors", [caches[1]])
    with pytest.raises(ValueError, match="missing"):
        load_cache(tmp_path / "one.safetensors")


# -- parameters (the bad settings: TestXKV.bad_settings) -------------------------------------------
def test_bad_specs_and_a_missing_rope_are_refused_early():
    with pytest.raises(ValueError, match="flush"):
        make("xkv:flush=2")
    k, v = kv_data(t=20)
    with pytest.raises(ValueError, match="RoPE"):
        XKVCache().update_and_fetch(k, v)
    c = XKVCache(pre_rope=False)
    c.update_and_fetch(k, v)
    assert c.offset == 20


def test_a_bfloat16_model_is_compressed_as_a_float16_one():
    """A bfloat16 model (Gemma 3 on a GPU) stores its latent in bfloat16: the group's update
    reads it through float32 (numpy holds no bfloat16) and stores what a float16 model's
    would."""
    model = _model(2)
    prompt = mx.random.randint(0, 512, (1, 300), key=mx.random.key(0))
    held = {}
    for dtype in (mx.float16, mx.bfloat16):
        model.set_dtype(dtype)
        caches = make_cache(
            model, "xkv:layer_group=2,key_rank=32,value_rank=48", storage_dtype=dtype
        )
        with routed(model):  # two chunks: the second updates the stored latent
            mx.eval(model(prompt[:, :150], cache=caches))
            out = model(prompt[:, 150:], cache=caches)
        mx.eval(out)
        assert mx.all(mx.isfinite(out)).item()
        held[dtype] = sum(c.nbytes for c in caches)
    assert held[mx.bfloat16] == held[mx.float16]
