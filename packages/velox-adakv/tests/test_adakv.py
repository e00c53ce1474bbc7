"""Ada-KV: the conformance suite, and what is Ada-KV's own."""

import math
import sys
import types
from typing import ClassVar

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import QuantizedKVCache

import velox_testing.eviction as ev
from velox_adakv import METHOD, AdaKVCache, AdaKVPolicy, adaptive_keep, allocate
from velox_core import (
    Method,
    RetentionPolicy,
    Uniform,
    VeloxCache,
    make_cache,
    routed,
)
from velox_core.policy import pool_votes
from velox_testing import feed, kv_data, rel_error, tiny_model

SDPA = mx.fast.scaled_dot_product_attention


def evicted(cache, k, v, q, chunk=100, scale=0.1):
    """Prefill ``k, v`` in chunks, each followed by attention with ``q`` (observed, as a
    model's layer would attend), then one decode step (the eviction); under routed attention."""
    mask = "causal" if q.shape[2] > 1 else None
    with routed():
        for s in range(0, k.shape[2], chunk):
            cache.update_and_fetch(k[:, :, s : s + chunk], v[:, :, s : s + chunk])
            cache.attend(q, scale, mask=mask)
        cache.update_and_fetch(k[:, :, -1:], v[:, :, -1:])
    return cache


class TestAdaKV(ev.FullBudgetConformance):
    max_memory_ratio = 1.03  # int32 positions (0.8%) and the body's growth slack beside the window

    bad_settings = (
        {"budget": 32},
        {"alpha": 1.5},
        {"alpha": "0.2"},
        {"observe": 0},
        {"kernel": 4},
        {"pooling": "min"},
        {"base": "h2o"},
        {"ratio": 0.5},
    )

    def make(self):
        return AdaKVCache(budget=4096)


class TestAdaKVEvicting(ev.Routed, ev.EvictingConformance):
    """Small budget, 4-bit codes, per-head storage (batch 1). Per-head storage is read only by
    velox attention, so every test runs under routed attention. Two tests are replaced by
    their per-head forms: ``keys_and_values`` has no single layout once heads differ, and a
    batch of 2 uses the documented uniform split."""

    def make(self, **kw):
        return AdaKVCache(**{"budget": 64, "window": 16, "every": 8, "bits": 4, **kw})

    def test_attend_matches_decoded(self):
        k, v = kv_data(t=300)
        q = mx.random.normal((1, 4, 4, 128), key=mx.random.key(20)).astype(mx.float16)
        c = evicted(self.make(), k, v, q)
        assert c.ragged
        for lq, mask in ((1, None), (3, "causal")):
            q = mx.random.normal((1, 4, lq, 128), key=mx.random.key(lq)).astype(mx.float16)
            got = c.attend(q, scale=0.1, mask=mask)
            for h in range(2):
                segs = c._head_segments(h)
                kk = mx.concatenate([s.key_codec.decode(s.keys) for s in segs], axis=2)
                vv = mx.concatenate([s.value_codec.decode(s.values) for s in segs], axis=2)
                ref = SDPA(q[:, 2 * h : 2 * h + 2].astype(mx.float32), kk, vv, scale=0.1, mask=mask)
                assert rel_error(got[:, 2 * h : 2 * h + 2], ref) < 1e-2

    def test_batch(self):
        """Batch 2 falls back to the uniform split: row by row it equals single caches with
        ``alpha=1`` (the uniform split), scored by the same observed queries."""
        k, v = kv_data(b=2, t=140)
        q = mx.random.normal((2, 4, 2, 128), key=mx.random.key(9)).astype(mx.float16)
        batched = evicted(self.make(), k, v, q, chunk=70)
        assert not batched.ragged and len(set(batched.body_sizes())) == 1
        out = batched.attend(q[:, :, -1:], scale=0.1)
        for i in range(2):
            single = evicted(self.make(alpha=1.0), k[i : i + 1], v[i : i + 1], q[i : i + 1], 70)
            ref = single.attend(q[i : i + 1, :, -1:], scale=0.1)
            assert rel_error(out[i : i + 1], ref) < 1e-2
        one = batched.extract(1)
        assert rel_error(one.attend(q[1:2, :, -1:], scale=0.1), out[1:2]) < 1e-3


# -- the allocation -------------------------------------------------------------------------------
def _random_scores(rng, sizes):
    return [
        mx.array(rng.dirichlet(np.full(n, rng.uniform(0.05, 2.0))).astype(np.float32))
        for n in sizes
    ]


@pytest.mark.parametrize("alpha", [0.0, 0.2, 0.5, 1.0])
def test_allocation_sums_to_the_layer_budget_and_keeps_the_floor(alpha):
    rng = np.random.default_rng(0)
    for sizes, k in (([200, 200, 200, 200], 50), ([300, 40, 120], 60), ([90, 10], 45)):
        scores = _random_scores(rng, sizes)
        n = allocate(scores, k, alpha)
        assert sum(n) == len(sizes) * k
        assert all(min(int(alpha * k), t) <= a <= t for a, t in zip(n, sizes)), (n, sizes)
        if alpha == 1.0 and min(sizes) >= k:
            assert n == [k] * len(sizes)
        keep = adaptive_keep(scores, k, alpha)
        assert [int(i.size) for i in keep] == n
        assert all(np.all(np.diff(np.array(i)) > 0) for i in keep)  # temporal order
    assert allocate(_random_scores(rng, [10, 5]), 20, 0.2) == [10, 5]  # fewer than the budget


def test_adaptive_split_keeps_at_least_the_mass_of_the_uniform_split():
    """The paper's bound: kept attention mass over the layer is what the allocation maximizes;
    with alpha=0 it is the global optimum, and the safeguard never falls below uniform."""
    rng = np.random.default_rng(1)
    for _ in range(5):
        scores = _random_scores(rng, [256] * 4)
        np_s = [np.array(s) for s in scores]
        k = 32
        uniform = sum(np.sort(s)[-k:].sum() for s in np_s)
        best = np.sort(np.concatenate(np_s))[-4 * k :].sum()
        for alpha in (0.0, 0.2, 0.5):
            keep = adaptive_keep(scores, k, alpha)
            mass = sum(s[np.array(i)].sum() for s, i in zip(np_s, keep))
            assert mass >= uniform - 1e-6
            if alpha == 0.0:
                assert abs(mass - best) < 1e-5


def test_concentrated_heads_get_less_budget_than_spread_heads():
    """The paper's motivation: a head whose attention sits on a few tokens needs few; a head
    that spreads it needs many."""
    peaked = np.full(200, 1e-4)
    peaked[[10, 70, 150]] = [0.5, 0.3, 0.18]
    flat = np.full(200, 1 / 200)
    n = allocate([mx.array(peaked / peaked.sum()), mx.array(flat)], 40, 0.2)
    assert n[0] < 40 < n[1] and n[0] >= 8
    # end to end: queries attend sharply on head 0 and evenly on head 1
    rng = np.random.default_rng(2)
    d, t = 64, 240
    k = rng.normal(0, 0.05, (1, 2, t, d))
    k[0, 0, [30, 90, 160], :] = 4.0  # head 0: three tokens aligned with the queries
    q = np.full((1, 2, 8, d), 0.5)
    c = AdaKVCache(budget=48, window=8, kernel=1)
    kk, vv = mx.array(k, dtype=mx.float16), mx.array(rng.normal(size=(1, 2, t, d)), mx.float16)
    evicted(c, kk, vv, mx.array(q, dtype=mx.float16), chunk=120, scale=d**-0.5)
    sizes = c.body_sizes()
    assert sizes[0] < 40 < sizes[1] and sizes[0] >= int(0.2 * 40)
    pos0 = set(np.array(c.policy_view.body_positions()[0][0]).tolist())
    assert {30, 90, 160} <= pos0


# -- the SnapKV scorer ----------------------------------------------------------------------------
def test_snapkv_vote_matches_a_direct_computation():
    """Softmax over all stored tokens a query sees (sinks and window included, causal), mean
    over the window's queries and the query group, max-pooled over 7 positions."""
    k, v = kv_data(t=120, d=64, seed=3)
    q = mx.random.normal((1, 4, 10, 64), key=mx.random.key(4)).astype(mx.float16)
    c = AdaKVCache(budget=200, sinks=2, window=12, observe=6)
    with routed():
        feed(c, k, v, 60)
        c.attend(q, 0.125, mask="causal")
    got = c.policy.score(c.policy_view)
    kn, qn = np.array(k.astype(mx.float32))[0], np.array(q.astype(mx.float32))[0]
    qpos = np.arange(114, 120)  # the last 6 queries
    body = np.arange(2, 108)
    for h in range(2):
        logits = np.einsum("rwd,td->rwt", qn[2 * h : 2 * h + 2, -6:], kn[h]) * 0.125
        logits = np.where(np.arange(120)[None, None] <= qpos[None, :, None], logits, -np.inf)
        w = np.exp(logits - logits.max(-1, keepdims=True))
        w /= w.sum(-1, keepdims=True)
        vote = w[..., body].mean(axis=(0, 1))
        pooled = np.array([vote[max(0, i - 3) : i + 4].max() for i in range(len(body))])
        np.testing.assert_allclose(np.array(got[h][0]), pooled, rtol=1e-4, atol=1e-7)


def test_pooling_joins_positions_not_storage_neighbours():
    s = mx.array([[1.0, 0.0, 0.0, 5.0, 0.0]])
    pos = mx.array([[0, 1, 2, 20, 21]], dtype=mx.int32)
    assert np.array(pool_votes(s, pos, None, 3, "max")).tolist() == [[1.0, 1.0, 0.0, 5.0, 5.0]]
    avg = np.array(pool_votes(s, pos, None, 3, "avg"))[0]
    np.testing.assert_allclose(avg, [1 / 3, 1 / 3, 0.0, 5 / 3, 5 / 3], rtol=1e-6)


# -- eviction and storage -------------------------------------------------------------------------
def test_eviction_output_equals_attention_over_each_heads_kept_tokens():
    k, v = kv_data(t=400)
    q = mx.random.normal((1, 4, 8, 128), key=mx.random.key(5)).astype(mx.float16)
    c = evicted(AdaKVCache(budget=100, sinks=4, window=16), k, v, q)
    assert c.ragged and sum(c.body_sizes()) == 2 * (100 - 20) + 2
    qd = mx.random.normal((1, 4, 3, 128), key=mx.random.key(6)).astype(mx.float16)
    with routed():
        got = c.attend(qd, 0.1, mask="causal")
    kk, vv = mx.concatenate([k, k[:, :, -1:]], 2), mx.concatenate([v, v[:, :, -1:]], 2)
    for h in range(2):
        kept = np.concatenate(
            [np.arange(4), np.array(c.policy_view.body_positions()[h][0]), np.arange(385, 401)]
        )
        idx = mx.array(kept)
        ref = SDPA(
            qd[:, 2 * h : 2 * h + 2],
            kk[:, h : h + 1, idx],
            vv[:, h : h + 1, idx],
            scale=0.1,
            mask="causal",
        )
        assert rel_error(got[:, 2 * h : 2 * h + 2], ref) < 2e-3


def test_per_head_storage_costs_no_padding():
    """Moving budget between heads costs nothing: the bytes equal those of the same total
    under a uniform split (alpha=1), and are less than padding every head to the widest."""
    k, v = kv_data(h=4, t=600, seed=7)
    q = mx.random.normal((1, 8, 8, 128), key=mx.random.key(7)).astype(mx.float16)
    ada = evicted(AdaKVCache(budget=120, bits=4, window=8), k, v, q)
    uni = evicted(AdaKVCache(budget=120, bits=4, window=8, alpha=1.0), k, v, q)
    mx.eval(ada.state, uni.state)
    sizes = ada.body_sizes()
    assert ada.ragged and not uni.ragged and len(set(sizes)) > 1
    assert sum(sizes) == sum(uni.body_sizes()) == 4 * (112 + 1)
    per_token = 2 * (64 + 2 * 2 * 2)  # K and V: 4-bit codes, fp16 scale and zero per 64
    pos_bytes = 4 * sum(sizes)  # int32 positions, in both layouts
    assert ada.logical_nbytes == uni.logical_nbytes  # positions included: 4 B per token in both
    padded = uni.logical_nbytes + (4 * max(sizes) - sum(sizes)) * (per_token + 4)
    assert ada.logical_nbytes < padded
    window, queries = 4 * 8 * 2 * 128 * 2, 8 * 32 * 128 * 2  # fp16 window; observed queries
    assert ada.logical_nbytes == sum(sizes) * per_token + pos_bytes + window + queries


def test_batch_above_one_splits_uniformly_and_per_head_storage_needs_batch_one():
    k, v = kv_data(b=2, t=300)
    q = mx.random.normal((2, 4, 4, 128), key=mx.random.key(8)).astype(mx.float16)
    c = evicted(AdaKVCache(budget=80, window=8), k, v, q)
    assert not c.ragged and c.body_sizes() == [73, 73]  # 72 kept + the new token
    with pytest.raises(ValueError, match="batch size 1"):
        c.evict([mx.arange(10), mx.arange(20)])


def test_per_head_budgets_need_routed_attention():
    k, v = kv_data(t=200)
    c = AdaKVCache(budget=64, window=8)
    feed(c, k, v, 200)  # nothing due yet
    with pytest.raises(ValueError, match="routed"):
        c.update_and_fetch(k[:, :, :1], v[:, :, :1])
    assert c.offset == 200 and c.body_sizes() == [192, 192]  # nothing was evicted
    with routed():
        c.update_and_fetch(k[:, :, :1], v[:, :, :1])
    assert c.ragged and c.offset == 201 and sum(c.body_sizes()) == 2 * 57
    model = tiny_model("llama")
    prompt = mx.random.randint(0, 512, (1, 120), key=mx.random.key(0))
    caches = [AdaKVCache(budget=48, window=8) for _ in model.layers]
    model(prompt[:, :60], cache=caches)
    with pytest.raises(ValueError, match="routed"):
        model(prompt[:, 60:], cache=caches)


def test_positions_survive_evictions():
    """The same token at the same position keeps the same rotated key, head by head."""
    k, v = kv_data(t=500, seed=9)
    q = mx.random.normal((1, 4, 8, 128), key=mx.random.key(9)).astype(mx.float16)
    c = evicted(AdaKVCache(budget=150, window=8), k, v, q)  # fp16: exact
    for h in range(2):
        pos = np.array(c.policy_view.body_positions()[h][0])
        assert np.all(np.diff(pos) > 0)
        assert mx.array_equal(
            c.policy_view.body_keys()[h][0, 0], k[0, h, mx.array(pos)].astype(mx.float32)
        )
    coded = VeloxCache(Uniform(4), Uniform(4), window=8, policy=AdaKVPolicy(budget=150))
    with routed():
        feed(coded, k[:, :, :300], v[:, :, :300], 150)
        before = [
            dict(zip(np.array(p[0]).tolist(), np.array(kk[0, 0])))
            for p, kk in zip(coded.policy_view.body_positions(), coded.policy_view.body_keys())
        ]
        coded.attend(q, 0.1, mask="causal")
        coded.update_and_fetch(k[:, :, 300:301], v[:, :, 300:301])
        feed(coded, k[:, :, 301:], v[:, :, 301:], 199)
        coded.update_and_fetch(k[:, :, :1], v[:, :, :1])
    assert coded.ragged
    for h in range(2):
        pos = np.array(coded.policy_view.body_positions()[h][0]).tolist()
        keys = np.array(coded.policy_view.body_keys()[h][0, 0])
        hits = [i for i, p in enumerate(pos) if p in before[h]]
        assert len(hits) > 10
        for i in hits:
            np.testing.assert_array_equal(keys[i], before[h][pos[i]])


def test_tiny_model_chunked_prefill_stays_within_budget_plus_a_chunk():
    model = tiny_model("llama")
    prompt = mx.random.randint(0, 512, (1, 300), key=mx.random.key(1))
    caches = [AdaKVCache(budget=96, window=16, every=16) for _ in model.layers]
    with routed(model):
        peak = 0
        for s in range(0, 300, 64):
            model(prompt[:, s : s + 64], cache=caches)
            peak = max(peak, max(sum(c.body_sizes()) / 2 + c.protected() for c in caches))
        for t in range(40):
            out = model(prompt[:, t : t + 1], cache=caches)
    assert peak <= 96 + 64
    assert all(c.offset == 340 for c in caches)
    assert all(sum(c.body_sizes()) / 2 + c.protected() <= 96 + 16 for c in caches)
    assert any(len(set(c.body_sizes())) > 1 for c in caches)  # heads got different budgets
    assert out.shape == (1, 1, 512)


def test_state_and_files_keep_per_head_storage_and_queries(tmp_path):
    k, v = kv_data(t=300)
    q = mx.random.normal((1, 4, 8, 128), key=mx.random.key(10)).astype(mx.float16)
    c = evicted(AdaKVCache(budget=64, window=8, bits=4, every=4), k, v, q)
    d = ev.reloaded(c, tmp_path / "c.safetensors")
    assert d.ragged and d.body_sizes() == c.body_sizes() and d.offset == c.offset
    assert mx.array_equal(d.policy.state()["queries"], c.policy.state()["queries"])
    with routed():
        for cache in (c, d):
            feed(cache, k[:, :, :20], v[:, :, :20], 1)  # decode evictions, scored by queries
        assert d.body_sizes() == c.body_sizes()
        assert mx.array_equal(d.attend(q[:, :, -1:], 0.1), c.attend(q[:, :, -1:], 0.1))


# -- the 4-bit setting against mlx ----------------------------------------------------------------
def _mlx_q4(x):
    w, s, z = mx.quantize(x, group_size=64, bits=4)
    return mx.dequantize(w, s, z, group_size=64, bits=4)


def test_four_bit_setting_against_mlx_q4():
    """``budget=1024, bits=4``: once eviction is in force (4,096 tokens) it holds fewer bytes
    than mlx-lm's QuantizedKVCache(64, 4) fed the same tokens; within the budget (nothing
    evicted) its attention error is that of 4-bit group-64 codes, as mlx's own."""
    d, scale = 128, 1 / math.sqrt(128)
    setting = {"budget": 1024, "bits": 4}
    k, v = kv_data(t=4096, d=d)
    q = mx.random.normal((1, 4, 8, d), key=mx.random.key(11)).astype(mx.float16)
    ours, theirs = AdaKVCache(**setting), QuantizedKVCache(group_size=64, bits=4)
    evicted(ours, k, v, q, chunk=512)
    feed(theirs, mx.concatenate([k, k[:, :, -1:]], 2), mx.concatenate([v, v[:, :, -1:]], 2), 4097)
    mx.eval(theirs.state, ours.state)
    assert ours.nbytes <= 0.35 * theirs.nbytes, (ours.nbytes, theirs.nbytes)
    for seed in (0, 1, 2):
        k, v = kv_data(t=1000, d=d, seed=seed)
        q = mx.random.normal((1, 4, 16, d), key=mx.random.key(seed)) + k[:, :1, -1:] / 4
        q = q.astype(mx.float16)
        c = feed(AdaKVCache(**setting), k, v, 250)
        ref = SDPA(q, k, v, scale=scale)
        mlx = rel_error(SDPA(q, _mlx_q4(k), _mlx_q4(v), scale=scale), ref)
        assert rel_error(c.attend(q, scale), ref) <= 1.05 * mlx


# -- the Q-Filters base ---------------------------------------------------------------------------
class _KeyChannelPolicy(RetentionPolicy):
    """A stand-in velox_qfilters policy: scores a key by the sum of its channels."""

    name = "qfilters-stand-in"
    bound: ClassVar[list] = []

    def bind(self, model=None, layer=None):
        self.bound.append(layer)

    def score(self, view):
        return [None if k is None else mx.sum(k[:, 0], axis=-1) for k in view.body_keys()]


def test_qfilters_base_needs_the_package(monkeypatch):
    monkeypatch.setitem(sys.modules, "velox_qfilters", None)  # import fails
    with pytest.raises(ImportError, match="velox-qfilters"):
        AdaKVCache(base="qfilters")


def test_qfilters_base_allocates_over_its_per_key_scores(monkeypatch):
    fake = types.ModuleType("velox_qfilters")
    fake.METHOD = Method("qfilters", AdaKVCache, "stand-in", policies=(_KeyChannelPolicy,))
    monkeypatch.setitem(sys.modules, "velox_qfilters", fake)
    k, v = kv_data(t=300, seed=12)
    c = AdaKVCache(base="qfilters", budget=60, window=4)
    c.bind(None, 3)
    assert _KeyChannelPolicy.bound[-1] == 3
    with routed():
        feed(c, k, v, 150)
        c.update_and_fetch(k[:, :, :1], v[:, :, :1])
    s = [mx.sum(k[0, h, :296].astype(mx.float32), axis=-1) for h in range(2)]
    want = adaptive_keep(s, 56, 0.2)
    for h in range(2):
        got = np.array(c.policy_view.body_positions()[h][0])[:-1]  # the new token is appended last
        np.testing.assert_array_equal(got, np.array(want[h]))


def test_qfilters_base_with_the_real_package(tmp_path, monkeypatch):
    qf = pytest.importorskip("velox_qfilters")
    model = tiny_model("llama")
    ids = np.random.default_rng(0).integers(0, 512, 600)
    fitted = qf.fit_filters(model, ids, seq_len=300, samples=200)
    path = qf.save_filters(fitted, tmp_path / "tiny.safetensors")
    monkeypatch.setenv("VELOX_ARTIFACTS", str(tmp_path))
    caches = make_cache(model, AdaKVCache(base="qfilters", budget=64, window=8))
    prompt = mx.random.randint(0, 512, (1, 200), key=mx.random.key(2))
    with routed(model):
        for s in range(0, 200, 50):
            model(prompt[:, s : s + 50], cache=caches)
        c, f = caches[0], qf.load_filters(path).layer(0)
        before = c.policy_view.body_positions()
        want = adaptive_keep(
            [k[0, 0] @ f[h] for h, k in enumerate(c.policy_view.body_keys())], 56, 0.2
        )
        model(prompt[:, :1], cache=caches)
    assert all(sum(c.body_sizes()) == 2 * 57 and c.offset == 201 for c in caches)
    for h in range(2):
        got = np.array(c.policy_view.body_positions()[h][0])[:-1]
        np.testing.assert_array_equal(got, np.array(before[h][0])[np.array(want[h])])


def test_extracted_rows_keep_their_observed_queries():
    k, v = kv_data(b=2, t=200, seed=13)
    q = mx.random.normal((2, 4, 4, 128), key=mx.random.key(13)).astype(mx.float16)
    with routed():
        batched = feed(AdaKVCache(budget=64, window=8), k, v, 200)
        batched.attend(q, 0.1, mask="causal")
        one = batched.extract(1)
        single = feed(AdaKVCache(budget=64, window=8), k[1:], v[1:], 200)
        single.attend(q[1:], 0.1, mask="causal")
        for c in (one, single):
            c.update_and_fetch(k[1:, :, :1], v[1:, :, :1])
    assert one.ragged and one.body_sizes() == single.body_sizes()
    for a, b in zip(one.policy_view.body_positions(), single.policy_view.body_positions()):
        assert mx.array_equal(a, b)


# -- settings -------------------------------------------------------------------------------------
def test_recommended_settings_build():
    assert METHOD.recommended == (
        {"budget": 1024, "kernel": 15},
        {"budget": 1024, "kernel": 15, "bits": 8},
    )
    for s in METHOD.recommended:
        c = AdaKVCache(**s)
        assert isinstance(c.policy, AdaKVPolicy) and c.policy.alpha == 0.2 and c.window == 32
