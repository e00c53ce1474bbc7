"""KNorm: the conformance suite, and what is KNorm's own."""

import contextlib
import math

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import KVCache

import velox_testing.eviction as ev
from velox_core import Uniform, VeloxCache, make_cache, routed
from velox_knorm import METHOD, KNormCache, KNormPolicy, key_norm_scores
from velox_testing import kv_data, tiny_model
from velox_testing.eviction import kept_positions as kept

D = 64


class TestKNorm(ev.FullBudgetConformance):
    spec = "knorm:budget=4096"
    bad_settings = (
        {"skip_layers": [0, 1]},  # the authors' option: per-layer caches do it (docs)
        ({"budget": 20, "sinks": 4, "window": 16}, "budget"),
    )


class TestKNormEvicting(ev.EvictingConformance):
    """A small budget, decode cuts and 4-bit codes; query-free, so nothing is routed."""

    spec = "knorm:budget=64,every=8,bits=4"
    precise_spec = "knorm:budget=64,every=8"


# -- helpers ---------------------------------------------------------------------------------
def normed(t, h=2, seed=0, d=D):
    """Keys whose norms are a random permutation of distinct values per head (float32), and
    values: ``k, v`` ``(1, h, t, d)`` and the norms ``(h, t)`` (float64)."""
    rng = np.random.default_rng(seed)
    u = rng.normal(size=(1, h, t, d))
    u /= np.linalg.norm(u, axis=-1, keepdims=True)
    norms = np.stack([rng.permutation(np.linspace(1.0, 20.0, t)) for _ in range(h)])
    k = u * norms[None, :, :, None]
    v = rng.normal(size=(1, h, t, d))
    return mx.array(k.astype(np.float32)), mx.array(v.astype(np.float32)), norms


def lowest(norms, n, among=None):
    """Positions of the ``n`` lowest norms (among the positions ``among``, default all)."""
    idx = np.arange(norms.size) if among is None else np.array(sorted(among))
    return set(idx[np.argsort(norms[idx], kind="stable")[:n]].tolist())


# -- the mathematics ---------------------------------------------------------------------------
def test_score_is_minus_the_l2_norm_in_float32():
    k = np.random.default_rng(1).normal(0, 30, size=(2, 3, 50, D)).astype(np.float16)
    got = key_norm_scores(mx.array(k))
    assert got.dtype == mx.float32 and got.shape == (2, 3, 50)
    assert np.allclose(np.array(got), -np.linalg.norm(k.astype(np.float64), axis=-1), rtol=1e-6)


@pytest.mark.parametrize("chunk", [400, 64])
def test_keeps_exactly_the_lowest_norm_keys_of_each_head(chunk):
    """After the prompt (in one chunk or many) each head holds its ``budget`` lowest-norm
    tokens over the whole prompt: the authors' ``l2_compress`` (sort by norm, keep the
    first) with ``keep_ratio = budget / T``; the heads choose independently."""
    k, v, norms = normed(401)
    c = KNormCache(budget=40)
    for s in range(0, 400, chunk):
        e = min(s + chunk, 400)
        c.update_and_fetch(k[:, :, s:e], v[:, :, s:e])
    c.update_and_fetch(k[:, :, 400:], v[:, :, 400:])  # the cut, then one more token
    assert c.offset == 401 and c.size() == 41
    for h in range(2):
        assert kept(c, h) - {400} == lowest(norms[h, :400], 40)
        pos = mx.array(sorted(kept(c, h)))
        kk, _ = c.keys_and_values()
        assert mx.array_equal(kk[:, h], k[:, h, pos])  # the original (rotated) keys
    assert kept(c, 0) != kept(c, 1)


def test_decode_cuts_keep_the_lowest_norms_of_everything_seen():
    """With ``every=1`` the cache is a bounded state: after each step it holds the
    ``budget`` lowest-norm tokens seen so far, plus the newest one (not yet cut)."""
    k, v, norms = normed(300, seed=2)
    c = KNormCache(budget=32, every=1)
    c.update_and_fetch(k[:, :, :100], v[:, :, :100])
    for i in range(100, 300):
        c.update_and_fetch(k[:, :, i : i + 1], v[:, :, i : i + 1])
        assert c.size() == 33
        for h in range(2):
            assert kept(c, h) == lowest(norms[h, :i], 32) | {i}


def test_sinks_and_window_are_kept_whatever_their_norm():
    k, v, norms = normed(301, seed=3)
    k = np.array(k)
    k[:, :, :4] *= 100.0  # huge-norm sinks
    k[:, :, 284:] *= 100.0  # huge-norm recent tokens
    k = mx.array(k)
    c = KNormCache(budget=40, sinks=4, window=16)
    c.update_and_fetch(k[:, :, :300], v[:, :, :300])
    c.update_and_fetch(k[:, :, 300:], v[:, :, 300:])  # the cut, then token 300
    kk, _ = c.keys_and_values()
    assert mx.array_equal(kk[:, :, :4], k[:, :, :4])  # the sinks, as given
    assert c.size() == 41 and c.body_sizes() == [21, 21]
    for h in range(2):  # the body: the 20 lowest norms between the sinks and the window
        assert kept(c, h) - {284} == lowest(norms[h], 20, among=range(4, 284)), h
    # 284 left the window when 300 arrived (it was kept at the cut); the window: 285..300
    assert mx.array_equal(kk[:, :, -16:], k[:, :, 285:301])


def test_coded_keys_are_scored_from_their_codes_and_keep_well_separated_norms():
    k, v, norms = normed(200, seed=4)
    c = VeloxCache(Uniform(4, group=32), Uniform(4, group=32), policy=KNormPolicy(budget=30))
    c.update_and_fetch(k[:, :, :199], v[:, :, :199])
    c.update_and_fetch(k[:, :, 199:], v[:, :, 199:])
    for h in range(2):  # norms 0.1 apart: 4-bit codes keep the order of the lowest ones
        assert kept(c, h) - {199} == lowest(norms[h, :199], 30)


# -- the behaviour -----------------------------------------------------------------------------
def test_chunked_prefill_in_a_tiny_model_keeps_layer_zeros_lowest_norm_keys():
    """Inside a model, routed or not (KNorm needs no query): memory bounded by budget plus a
    chunk, absolute offsets, and at layer 0 (whose keys do not depend on the cache) exactly
    the lowest-norm keys of the whole prompt, as mlx-lm's own cache stores them."""
    model = tiny_model("llama")
    prompt = mx.random.randint(0, 512, (1, 300), key=mx.random.key(0))
    budget, chunk = 96, 64
    full = [KVCache() for _ in model.layers]
    model(prompt, cache=full)
    k0 = np.array(full[0].state[0][0, :, :300].astype(mx.float32))  # (H, 300, D)
    kept_sets = []
    for route in (False, True):
        caches = make_cache(model, KNormCache(budget=budget))
        with routed(model) if route else contextlib.nullcontext():
            for s in range(0, 300, chunk):
                model(prompt[:, s : s + chunk], cache=caches)
                assert all(c.size() <= budget + chunk for c in caches)
            out = model(prompt[:, -1:], cache=caches)
        assert out.shape == (1, 1, 512)
        assert all(c.offset == 301 and c.size() == budget + 1 for c in caches)
        c0 = caches[0]
        norms = np.linalg.norm(k0, axis=-1)
        for h in range(k0.shape[0]):
            assert kept(c0, h) - {300} == lowest(norms[h], budget), (route, h)
        kept_sets.append([kept(c, 0) for c in caches])
    assert kept_sets[0] == kept_sets[1]  # routing changes nothing KNorm sees


def test_saved_cache_keeps_its_policy_and_cuts_the_same(tmp_path):
    k, v, _ = normed(301, seed=5)
    c = KNormCache(budget=40, every=4, bits=4, group=32)
    c.update_and_fetch(k[:, :, :300], v[:, :, :300])
    d = ev.reloaded(c, tmp_path / "c.safetensors")
    ev.assert_resumes_alike(c, d, k, v)
    assert d.size() == 41


def test_batch_rows_choose_on_their_own_keys():
    k0, v0, n0 = normed(201, seed=6)
    k1, v1, n1 = normed(201, seed=7)
    k, v = mx.concatenate([k0, k1]), mx.concatenate([v0, v1])
    c = KNormCache(budget=24)
    c.update_and_fetch(k[:, :, :200], v[:, :, :200])
    c.update_and_fetch(k[:, :, 200:], v[:, :, 200:])
    pos = np.array(mx.stack(c.policy_view.body_positions(), axis=1))
    for row, norms in ((0, n0), (1, n1)):
        assert set(pos[row, 0].tolist()) - {200} == lowest(norms[0, :200], 24)


def test_four_bit_setting_holds_fewer_bytes_than_mlx_q4_past_the_budget():
    """The recommended 4-bit setting after 2,561 tokens of kv_data (prefill in 512-token
    chunks, a decode token) holds 1,025 tokens and fewer bytes than mlx-lm's
    QuantizedKVCache(64, 4) fed the same tokens (docs/knorm.md, Memory)."""
    from mlx_lm.models.cache import QuantizedKVCache

    t = 2560
    k, v = kv_data(t=t + 1, d=128)
    ours, theirs = KNormCache(**METHOD.recommended[1]), QuantizedKVCache(group_size=64, bits=4)
    for s in range(0, t + 1, 512):
        for c in (ours, theirs):
            c.update_and_fetch(k[:, :, s : s + 512], v[:, :, s : s + 512])
    mx.eval(ours.state, theirs.state)
    assert ours.size() == 1025 and ours.nbytes < theirs.nbytes
    per_token = 2 * (64 + 4 * 128 // 32) + 4  # 4-bit codes, fp16 scale and zero, int32 position
    assert ours.logical_nbytes == 1025 * 2 * per_token
    assert math.isclose(per_token, 164)


def test_recommended_settings_and_defaults():
    fp16, _ = ev.recommended_presets(METHOD)
    assert fp16.policy.config() == {"budget": 1024, "every": None}
    assert fp16.sinks == fp16.window == 0
    assert METHOD.paper == "https://arxiv.org/abs/2406.11430"


def test_the_policy_refuses_a_budget_of_nothing():
    with pytest.raises(ValueError, match="budget"):
        KNormPolicy(budget=0)
