"""MiniCache: the conformance suite, the layer pairs through make_cache, and the mathematics."""

import math

import mlx.core as mx
import numpy as np
import pytest

from velox_core import load_cache, make, make_cache, routed, save_cache
from velox_minicache import (
    MergedPair,
    MiniCache,
    distance_range,
    restore,
    retained,
    slerp_merge,
)
from velox_testing import (
    CacheConformance,
    assert_batch_generate_refused,
    assert_linked_copies,
    assert_rows_decode_alone,
    conformance_model,
    kv_data,
    rel_error,
)


class TestMiniCache(CacheConformance):
    # A cache made alone has no partner layer: it keeps every token in fp16 (the suite's
    # single-cache checks run on that). The model-level checks run through make_cache over
    # the tiny 2-layer llama, whose two layers form one pair (start_layer=0). Its random
    # weights make adjacent layers' states nearly orthogonal (no depth similarity to exploit):
    # make_precise keeps every token pair but the closest unmerged (gamma=1), hence a logit
    # cosine bound below the suite's default.
    max_memory_ratio = 1.0
    model_logit_cosine = 0.95

    bad_settings = (
        {"t": -0.1},
        {"t": 1.5},
        {"t": "half"},
        {"gamma": 2.0},
        {"gamma": -0.01},
        {"start_layer": -1},
        {"start_layer": 1.5},
        {"flush": 4},
        {"bits": 4},
    )

    def make(self):
        return MiniCache(start_layer=0)

    def make_precise(self):
        return MiniCache(start_layer=0, gamma=1.0)

    def test_batch_generate_ragged(self):
        """mlx-lm batches separately made caches by merging each layer's caches alone, which
        cannot keep a pair's shared tokens: a merged pair refuses it clearly (a batch
        prefilled together works: test_a_batch_prefilled_together_equals_each_row_alone)."""
        model = conformance_model()
        caches = make_cache(model, self.make())
        assert caches[0].group is caches[1].group
        with pytest.raises(ValueError, match="merged pair"):
            caches[0].merge([caches[0]])
        assert_batch_generate_refused(model, self.make, "merged pair")


# -- helpers ---------------------------------------------------------------------------------------
def _model(layers=2):
    return conformance_model(num_hidden_layers=layers)


def _pair(**kw):
    caches = [MiniCache(**kw) for _ in range(2)]
    MergedPair(caches)
    for i, c in enumerate(caches):
        c.layer = i
    return caches


def _np_slerp(x1, x2, t):
    """MiniCache's Eq. (3) row by row in float64: (direction, |x1|, |x2|, Omega / pi)."""
    x1, x2 = np.asarray(x1, np.float64), np.asarray(x2, np.float64)
    n1 = np.linalg.norm(x1, axis=-1, keepdims=True)
    n2 = np.linalg.norm(x2, axis=-1, keepdims=True)
    u1, u2 = x1 / n1, x2 / n2
    om = np.arccos(np.clip(np.sum(u1 * u2, -1, keepdims=True), -1, 1))
    e = np.sin((1 - t) * om) / np.sin(om) * u1 + np.sin(t * om) / np.sin(om) * u2
    return e, n1[..., 0], n2[..., 0], om[..., 0] / math.pi


def _f32(x):
    return np.array(x.astype(mx.float32))


# -- the mathematics ------------------------------------------------------------------------------
@pytest.mark.parametrize("t", [0.5, 0.3])
def test_slerp_merge_is_eq_3_of_the_paper(t):
    k1, _ = kv_data(t=64, seed=1, dtype=mx.float32)
    k2, _ = kv_data(t=64, seed=2, dtype=mx.float32)
    e, n1, n2, d = slerp_merge(k1, k2, t)
    ref_e, ref_n1, ref_n2, ref_d = _np_slerp(np.array(k1), np.array(k2), t)
    assert np.allclose(np.array(e), ref_e, atol=1e-5)
    assert np.allclose(np.array(n1), ref_n1, rtol=1e-5)
    assert np.allclose(np.array(n2), ref_n2, rtol=1e-5)
    assert np.allclose(np.array(d), ref_d, atol=1e-5)
    assert np.allclose(np.linalg.norm(np.array(e), axis=-1), 1.0, atol=1e-5)  # on the sphere
    # restoring with each layer's magnitude keeps that layer's norm exactly
    assert np.allclose(np.linalg.norm(np.array(restore(e, n2)), axis=-1), ref_n2, rtol=1e-5)


def test_slerp_endpoints_and_parallel_directions():
    k1, _ = kv_data(t=32, seed=3, dtype=mx.float32)
    k2, _ = kv_data(t=32, seed=4, dtype=mx.float32)
    e0, n1, _, _ = slerp_merge(k1, k2, 0.0)
    e1, _, n2, _ = slerp_merge(k1, k2, 1.0)
    assert rel_error(restore(e0, n1), k1) < 1e-5  # t = 0: layer l-1's direction
    assert rel_error(restore(e1, n2), k2) < 1e-5  # t = 1: layer l's
    # the same direction at both layers (another length): merged exactly, distance 0
    e, n1, n2, d = slerp_merge(k1, 3.0 * k1, 0.5)
    assert rel_error(restore(e, n2), 3.0 * k1) < 1e-5 and float(mx.max(d)) < 1e-3
    # opposite directions: a unit direction all the same (no NaN), at distance 1
    e, _, _, d = slerp_merge(k1, -k1, 0.5)
    assert np.allclose(np.linalg.norm(np.array(e), axis=-1), 1.0, atol=1e-5)
    assert float(mx.min(d)) > 0.999


def test_retention_keeps_the_pairs_within_gamma_of_the_largest_distance():
    rng = np.random.default_rng(5)
    d = rng.uniform(0.2, 0.7, size=(2, 3, 50)).astype(np.float32)
    lo, hi = distance_range(mx.array(d), None, None)
    assert np.allclose(np.array(lo), d.reshape(2, -1).min(-1))  # per sequence
    assert np.allclose(np.array(hi), d.reshape(2, -1).max(-1))
    for gamma in (0.0, 0.05, 0.3, 1.0):
        got = np.array(retained(mx.array(d), lo, hi, gamma))
        top, bot = d.reshape(2, -1).max(-1), d.reshape(2, -1).min(-1)
        ref = d > (top - gamma * (top - bot))[:, None, None]
        assert (got == ref).all()
    assert not np.array(retained(mx.array(d), lo, hi, 0.0)).any()  # gamma 0 merges all
    assert np.array(retained(mx.array(d), lo, hi, 1.0)).sum() == 2 * 150 - 2  # all but closest
    # the range runs on: later tokens widen it, never narrow it
    lo2, hi2 = distance_range(mx.array(d[:, :, :5] * 0 + 0.9), lo, hi)
    assert np.allclose(np.array(hi2), 0.9) and np.allclose(np.array(lo2), np.array(lo))


def test_a_pair_stores_eq_3_with_per_layer_norms_and_the_retained_tokens_as_given():
    k1, v1 = kv_data(t=150, seed=6)
    k2, v2 = kv_data(t=150, seed=7)
    k2 = (0.7 * k2.astype(mx.float32) + 0.5 * k1.astype(mx.float32)).astype(mx.float16)
    c0, c1 = _pair(gamma=0.3)
    c0.update_and_fetch(k1, v1)
    c1.update_and_fetch(k2, v2)
    c0.update_and_fetch(k1[:, :, :1], v1[:, :, :1])  # the next update merges the chunk
    assert c0._merged == c1._merged == c0.group.tokens == 150
    for kind, (x1, x2) in enumerate(((k1, k2), (v1, v2))):
        e, n1, n2, d = _np_slerp(_f32(x1), _f32(x2), 0.5)
        flat = d.reshape(1, -1)
        keep = d > flat.max() - 0.3 * (flat.max() - flat.min())
        assert 0 < keep.sum() < keep.size
        pos = np.array(c0.group.pos[kind])
        assert set(map(tuple, pos)) == {(h, t) for h, t in zip(*np.nonzero(keep[0]))}
        for c, x, n in ((c0, x1, n1), (c1, x2, n2)):
            got = _f32(c.keys_and_values()[kind][:, :, :150])
            ref = np.where(keep[..., None], _f32(x), n[..., None] * e)
            assert np.abs(got - ref).max() <= 2e-3 * np.abs(ref).max()  # fp16 storage
            assert np.array_equal(got[keep], _f32(x)[keep])  # retained: exactly as given


# -- the pairs ------------------------------------------------------------------------------------
def test_make_cache_pairs_adjacent_layers_from_the_middle():
    caches = make_cache(_model(6), "minicache")
    assert [c.group is not None for c in caches] == [False, False, False, True, True, False]
    assert caches[3].group is caches[4].group and caches[3].group.layers == [3, 4]
    caches = make_cache(_model(6), "minicache:start_layer=1")
    assert caches[1].group is caches[2].group is not caches[3].group
    assert caches[3].group is caches[4].group and caches[5].group is None
    again = make_cache(_model(6), "minicache:start_layer=1")
    assert again[1].group is not caches[1].group  # each make_cache call makes new pairs
    with pytest.raises(ValueError, match="no pair"):
        make_cache(_model(6), "minicache:start_layer=5")
    with pytest.raises(ValueError, match="same settings"):
        make_cache(_model(2), "minicache:start_layer=0", layers={1: "fp16"})
    with pytest.raises(ValueError, match="same settings"):
        make_cache(_model(2), "minicache:start_layer=0", layers={1: "minicache:t=0.3"})


def test_new_tokens_stay_fp16_until_the_pairs_next_update():
    c0, c1 = _pair()
    k, v = kv_data(t=120)
    c0.update_and_fetch(k, v)
    c1.update_and_fetch(k * 0.5, v)
    # both layers attend their chunk as given: nothing is merged until the next update
    assert (
        c0._merged == c1._merged == 0
        and c0.stored.window[0].tokens == c1.stored.window[0].tokens == 120
    )
    assert mx.array_equal(c1.keys_and_values()[0], k * 0.5)
    c0.update_and_fetch(k[:, :, :1], v[:, :, :1])  # layer l-1's next step merges the chunk
    assert c0._merged == c1._merged == 120 and c1.stored.window[0].tokens == 0
    assert c0.stored.window[0].tokens == 1
    c1.update_and_fetch(k[:, :, 1:2], v[:, :, 1:2])
    kk, _ = c1.keys_and_values()
    assert c1.size() == c1.offset == 121 and mx.array_equal(kk[:, :, -1:], k[:, :, 1:2])
    for c in (c0, c1):  # decode tokens are merged one step later, as the paper's are
        c.update_and_fetch(k[:, :, :1], v[:, :, :1])
    assert c0._merged == c1._merged == 121


def test_the_shared_tokens_count_once_in_the_models_bytes():
    model = _model(4)  # pairs [0, 1] and [2, 3]
    caches = make_cache(model, "minicache:start_layer=0,gamma=0.2", storage_dtype=mx.float16)
    with routed(model):
        model(mx.random.randint(0, 512, (1, 300), key=mx.random.key(0)), cache=caches)
        model(mx.array([[7]]), cache=caches)  # merges the prompt
    h, d, t = 2, 128, 300
    for first, second in ((0, 1), (2, 3)):
        pair = caches[first].group
        shared = sum(a.nbytes for s in pair.dirs for a in s.arrays()) + sum(
            a.nbytes for a in pair.shared_arrays().values()
        )
        assert caches[first].nbytes - caches[second].nbytes == shared
        n_k, n_v = (p.shape[0] for p in pair.pos)
        # one direction per merged token (keys, values) for the pair; per layer its norms,
        # its retained rows and one decode token in the window
        logical = 2 * h * t * d * 2 + n_k * 2 * 4 + n_v * 2 * 4 + 4 * 4
        per_layer = 2 * h * t * 2 + (n_k + n_v) * d * 2 + 2 * h * d * 2
        assert caches[first].logical_nbytes + caches[second].logical_nbytes == (
            logical + 2 * per_layer
        )
        assert logical + 2 * per_layer < 2 * (2 * h * (t + 1) * d * 2)  # below two fp16 layers
    # the sum of every layer's bytes is the sum of the distinct resident arrays
    unique = {}
    for c in caches:
        for s in c.named_stores().values():
            unique.update({id(a): a.nbytes for a in s.arrays()})
        unique.update({id(a): a.nbytes for a in c._extra_arrays()})
    assert sum(c.nbytes for c in caches) == sum(unique.values())


def test_a_batch_prefilled_together_equals_each_row_alone():
    model = _model(2)
    prompt = mx.random.randint(0, 512, (2, 60), key=mx.random.key(3))
    assert_rows_decode_alone(model, "minicache:start_layer=0,gamma=0.3", prompt)


def test_trim_into_the_merged_tokens_then_continue():
    c0, c1 = _pair(gamma=0.5)
    k, v = kv_data(t=200)
    for c in (c0, c1):
        c.update_and_fetch(k[:, :, :150], v[:, :, :150])
    c0.update_and_fetch(k[:, :, 150:151], v[:, :, 150:151])
    c1.update_and_fetch(k[:, :, 150:151], v[:, :, 150:151])
    c0.trim(31)  # one window token, then 30 merged ones: the pair keeps them for layer 1
    assert c0.size() == c0.offset == 120 and c0.group.tokens == 150
    assert c0.keys_and_values()[0].shape[2] == 120
    c1.trim(31)
    assert c0.group.tokens == 120 and all(int(p[:, 1].max()) < 120 for p in c0.group.pos)
    for c in (c0, c1):
        c.update_and_fetch(k[:, :, 120:200], v[:, :, 120:200])
    c0.update_and_fetch(k[:, :, :1], v[:, :, :1])
    assert c0._merged == c1._merged == 200 and c1.size() == c1.offset == 200
    assert not c0.is_trimmable() and MiniCache().is_trimmable()


# -- files and copies -----------------------------------------------------------------------------
def test_save_load_and_deepcopy_of_the_whole_model_keep_the_pairs(tmp_path):
    model = _model(5)  # pairs [0, 1] and [2, 3]; layer 4 fp16
    caches = make_cache(model, "minicache:start_layer=0,gamma=0.2")
    for other in assert_linked_copies(model, caches, tmp_path / "m.safetensors", "dir"):
        assert other[0].group is other[1].group is not other[2].group is other[3].group
        assert other[4].group is None and other[1]._merged == caches[1]._merged


def test_a_layer_saved_without_its_pair_is_refused(tmp_path):
    model = _model(2)
    caches = make_cache(model, "minicache:start_layer=0")
    with routed(model):
        model(mx.random.randint(0, 512, (1, 60), key=mx.random.key(2)), cache=caches)
        model(mx.array([[3]]), cache=caches)
    save_cache(tmp_path / "one.safetensors", [caches[1]])
    with pytest.raises(ValueError, match="missing"):
        load_cache(tmp_path / "one.safetensors")
    alone = caches[1].copy()  # a copy of one layer holds the shared tokens itself
    assert alone.group.owner is alone and alone.size() == caches[1].size()
    assert rel_error(alone.keys_and_values()[0], caches[1].keys_and_values()[0]) < 1e-6


# -- parameters (the bad settings: TestMiniCache.bad_settings) -------------------------------------
def test_bad_specs_are_refused_early():
    with pytest.raises(ValueError, match="flush"):
        make("minicache:flush=2")
    with pytest.raises(ValueError, match="no pair"):
        make_cache(_model(2), "minicache:start_layer=1")  # layer 1 has no partner
    caches = make_cache(_model(2), "minicache")  # by default a 2-layer model merges (0, 1)
    assert caches[0].group is caches[1].group is not None
