"""CurDKV: the conformance suite, and what is CurDKV's own."""

import math

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import KVCache

import velox_testing.eviction as ev
from velox_core import Uniform, VeloxCache, make_cache
from velox_core.policy.view import PolicyView
from velox_curdkv import METHOD, CurDKVCache, CurDKVPolicy, gaussian_sketch, local_normalize
from velox_testing import tiny_model
from velox_testing.refusals import named_refusals

D = 64


class TestCurDKV(ev.FullBudgetConformance):
    spec = "curdkv:budget=4096"
    bad_settings = (
        {"leverage_type": "kv_avg"},  # kvpress's ablations are not parameters here
        *named_refusals(sketch=[-1, 2.5], local=[1, -16], seed=-1),
    )


class TestCurDKVEvicting(ev.EvictingConformance):
    """A small budget, decode cuts and 4-bit codes; query-free, so nothing is routed."""

    spec = "curdkv:budget=64,every=8,bits=4"
    precise_spec = "curdkv:budget=64,every=8"


# -- an independent NumPy transcription of the paper's reference scorer -----------------------
def numpy_kept(k, v, budget, sinks=4, sketch=20, local=16, seed=0, score="kv"):
    """Positions each head keeps after one cut of the whole sequence, as the reference code
    scores (float64): project by ``G`` (``N(0, 1/r)``, ``default_rng(seed)``), squared row
    norms, each normalised in windows of ``local`` positions from 0 (the last one padded),
    the product of key and value scores (``score="key"``: the key's alone), the first
    ``sinks`` forced in, the ``budget`` highest kept. ``k, v``: ``(H, T, D)``."""
    h, t, d = k.shape
    if sketch:
        g = np.random.default_rng(seed).standard_normal((d, sketch)) / math.sqrt(sketch)
        k, v = k @ g, v @ g
    out = []
    for i in range(h):
        parts = []
        for x in (k[i], v[i]):
            s = np.sum(x * x, axis=-1)
            if local:
                pad = np.concatenate([s, np.zeros((-t) % local)]).reshape(-1, local)
                s = (pad / pad.sum(axis=-1, keepdims=True)).reshape(-1)[:t]
            parts.append(s)
        s = parts[0] * parts[1] if score == "kv" else parts[0]
        s = s / s.sum()
        s[:sinks] = np.inf
        out.append(set(np.argsort(-s, kind="stable")[:budget].tolist()))
    return out


def data(t, h=2, seed=0, d=D):
    """Keys and values with varied norms, float32 ``(1, h, t, d)``, and float64 ``(h, t, d)``."""
    rng = np.random.default_rng(seed)
    k = rng.normal(size=(h, t, d)) * rng.uniform(0.2, 3.0, size=(h, t, 1))
    v = rng.normal(size=(h, t, d)) * rng.uniform(0.2, 3.0, size=(h, t, 1))
    k, v = k.astype(np.float32), v.astype(np.float32)
    return mx.array(k[None]), mx.array(v[None]), k.astype(np.float64), v.astype(np.float64)


def kept(cache, head):
    """Absolute positions of every token ``head`` holds (sinks, body, window)."""
    body = set(np.array(cache.policy_view.body_positions()[head][0]).tolist())
    sinks, window = cache.policy_view.protected()
    return body | set(sinks.positions.tolist()) | set(window.positions.tolist())


def cut(cache, k, v, t):
    """Feed ``k, v[:t]`` as one chunk and token ``t`` as a step (the cut runs before it)."""
    cache.update_and_fetch(k[:, :, :t], v[:, :, :t])
    cache.update_and_fetch(k[:, :, t : t + 1], v[:, :, t : t + 1])


# -- the mathematics ---------------------------------------------------------------------------
def test_sketch_is_gaussian_with_variance_one_over_r():
    g = np.array(gaussian_sketch(256, 400, seed=3))
    assert g.shape == (256, 400) and g.dtype == np.float32
    assert abs(g.mean()) < 0.01 and abs(g.var() * 400 - 1) < 0.02
    assert np.array_equal(g, np.array(gaussian_sketch(256, 400, seed=3)))
    assert not np.array_equal(g, np.array(gaussian_sketch(256, 400, seed=4)))


def test_local_normalisation_sums_to_one_per_window_of_absolute_positions():
    x = mx.array(np.random.default_rng(0).uniform(0.1, 1, (2, 20)).astype(np.float32))
    pos = mx.array(np.stack([np.arange(4, 24), np.arange(30, 50)]).astype(np.int32))
    got = np.array(local_normalize(x, pos, 8, 50 // 8 + 1))
    for row, p in enumerate(np.array(pos)):
        for w in set((p // 8).tolist()):
            assert math.isclose(got[row, p // 8 == w].sum(), 1.0, rel_tol=1e-5)
    whole = np.array(local_normalize(x, pos, 0, 1))
    assert np.allclose(whole.sum(axis=-1), 1.0)


@pytest.mark.parametrize(
    "settings",
    [{}, {"sketch": 0}, {"local": 0}, {"sketch": 8, "seed": 5}, {"local": 32, "sinks": 0}],
)
def test_keeps_what_the_reference_scorer_keeps(settings):
    """One cut over a 400-token prompt keeps, per head, exactly the tokens the NumPy
    transcription of the reference scorer keeps (sinks and the partial last window
    included)."""
    k, v, kn, vn = data(401, seed=1)
    budget = 60
    c = CurDKVCache(budget=budget, **settings)
    cut(c, k, v, 400)
    assert c.size() == budget + 1
    want = numpy_kept(kn[:, :400], vn[:, :400], budget, **settings)
    for h in range(2):
        assert kept(c, h) - {400} == want[h], h
    assert kept(c, 0) != kept(c, 1)


def test_a_large_value_is_kept_where_the_key_alone_would_drop_it():
    """The method's point: token 100 has a small key and a large value. Key leverage alone
    evicts it, CurDKV keeps it; and a token with the same small key and a small value is
    evicted by both."""
    k, v, kn, vn = data(301, h=1, seed=2)
    k, v = np.array(k), np.array(v)
    for pos, vscale in ((100, 20.0), (200, 0.3)):
        k[:, :, pos] *= 1.0 / np.linalg.norm(k[0, 0, pos]) * np.sqrt(D)
        v[:, :, pos] *= vscale / np.linalg.norm(v[0, 0, pos]) * np.sqrt(D)
    kn, vn = k[0].astype(np.float64), v[0].astype(np.float64)
    key_only = numpy_kept(kn[:, :300], vn[:, :300], 40, score="key")[0]
    both = numpy_kept(kn[:, :300], vn[:, :300], 40)[0]
    assert 100 not in key_only and 100 in both and 200 not in both
    c = CurDKVCache(budget=40)
    cut(c, mx.array(k), mx.array(v), 300)
    assert kept(c, 0) - {300} == both


# -- the behaviour -----------------------------------------------------------------------------
def test_the_seed_fixes_the_sketch_and_the_kept_tokens():
    k, v, _, _ = data(301, seed=3)
    runs = {}
    for seed in (0, 0, 1):
        c = CurDKVCache(budget=40, seed=seed)
        cut(c, k, v, 300)
        runs.setdefault(seed, []).append([kept(c, h) for h in range(2)])
    assert runs[0][0] == runs[0][1]
    assert runs[0][0] != runs[1][0]  # another G, another approximation


def test_budget_holds_during_decode():
    k, v, _, _ = data(300, seed=4)
    c = CurDKVCache(budget=32, every=4)
    c.update_and_fetch(k[:, :, :100], v[:, :, :100])
    for i in range(100, 300):
        c.update_and_fetch(k[:, :, i : i + 1], v[:, :, i : i + 1])
        assert c.size() <= 32 + 4 and c.offset == i + 1
    assert all(0 in kept(c, h) and 3 in kept(c, h) for h in range(2))  # the sinks stay


def test_sinks_and_window_are_kept_whatever_their_score():
    k, v, _, _ = data(301, seed=5)
    k = k * mx.array(np.r_[np.full(4, 1e-3), np.ones(281), np.full(16, 1e-3)])[:, None]
    c = CurDKVCache(budget=40, sinks=4, window=16)
    cut(c, k, v, 300)
    assert c.size() == 41 and c.body_sizes() == [21, 21]
    for h in range(2):
        assert set(range(4)) <= kept(c, h) and set(range(285, 301)) <= kept(c, h)


def test_layer_zero_of_a_model_keeps_what_the_reference_scorer_keeps():
    """Inside a model (one prefill chunk, then a step): layer 0, whose keys and values do
    not depend on the cache, keeps the reference scorer's tokens of mlx-lm's own cache."""
    model = tiny_model("llama")
    prompt = mx.random.randint(0, 512, (1, 300), key=mx.random.key(0))
    full = [KVCache() for _ in model.layers]
    model(prompt, cache=full)
    k0, v0 = (
        np.array(full[0].state[i][0, :, :300].astype(mx.float32)).astype(np.float64) for i in (0, 1)
    )
    caches = make_cache(model, CurDKVCache(budget=96))
    model(prompt, cache=caches)
    out = model(prompt[:, -1:], cache=caches)
    assert out.shape == (1, 1, 512) and all(c.size() == 97 for c in caches)
    want = numpy_kept(k0, v0, 96)
    for h in range(k0.shape[0]):
        assert kept(caches[0], h) - {300} == want[h], h


def test_kvpress_protocol_scores_each_layer_once_and_decodes_its_body_once(monkeypatch):
    """What a prompt costs beyond the model in kvpress's protocol (the context as one
    chunk, the question held whole, the answer decoded without ``every``): one score per
    layer, and each score decodes the body's keys and values once for all its heads, not
    once per head or per decoded token. A count, not a timing: it fails where cuts or
    decodes multiply."""
    calls = {"score": 0, "body_keys": 0, "body_values": 0}

    def counted(cls, name):
        inner = getattr(cls, name)

        def wrapper(self, *args):
            calls[name] += 1
            return inner(self, *args)

        monkeypatch.setattr(cls, name, wrapper)

    counted(CurDKVPolicy, "score")
    counted(PolicyView, "body_keys")
    counted(PolicyView, "body_values")
    model = tiny_model("llama")
    context = mx.random.randint(0, 512, (1, 200), key=mx.random.key(1))
    question = mx.random.randint(0, 512, (1, 12), key=mx.random.key(2))
    caches = make_cache(model, CurDKVCache(budget=64))
    model(context, cache=caches)
    logits = model(question, cache=caches)  # the context's cut runs before the question
    for c in caches:
        c.policy.hold_stored()
        c.policy.budget += question.shape[1]
    for _ in range(8):
        y = mx.argmax(logits[:, -1], axis=-1)
        logits = model(y[:, None], cache=caches)
    mx.eval(logits)
    layers = len(model.layers)
    assert caches[0].kv_heads > 1  # one decode of the body serves several heads
    assert calls == {"score": layers, "body_keys": layers, "body_values": layers}
    assert all(c.size() == 64 + 12 + 8 for c in caches)


def test_coded_tokens_are_scored_from_their_codes():
    k, v, _, _ = data(201, seed=6)
    c = VeloxCache(Uniform(8, group=32), Uniform(8, group=32), policy=CurDKVPolicy(budget=30))
    ref = CurDKVCache(budget=30, sinks=0)
    for x in (c, ref):
        cut(x, k, v, 200)
    overlap = [len(kept(c, h) & kept(ref, h)) for h in range(2)]
    assert min(overlap) >= 28  # 8-bit codes barely move the scores


def test_saved_cache_keeps_its_policy_and_cuts_the_same(tmp_path):
    k, v, _, _ = data(301, seed=7)
    c = CurDKVCache(budget=40, every=4, bits=4, group=32, sketch=12, seed=9, local=8)
    c.update_and_fetch(k[:, :, :300], v[:, :, :300])
    d = ev.reloaded(c, tmp_path / "c.safetensors")
    assert d.policy.config() == {"budget": 40, "every": 4, "sketch": 12, "local": 8, "seed": 9}
    ev.assert_resumes_alike(c, d, k, v)
    assert d.size() == 41


def test_batch_rows_choose_on_their_own_tokens():
    k0, v0, kn0, vn0 = data(201, seed=8)
    k1, v1, kn1, vn1 = data(201, seed=9)
    c = CurDKVCache(budget=24)
    cut(c, mx.concatenate([k0, k1]), mx.concatenate([v0, v1]), 200)
    pos = np.array(mx.stack(c.policy_view.body_positions(), axis=1))
    for row, (kn, vn) in enumerate(((kn0, vn0), (kn1, vn1))):
        want = numpy_kept(kn[:, :200], vn[:, :200], 24)
        assert set(pos[row, 0].tolist()) | set(range(4)) == want[0] | {200}


def test_recommended_settings_and_defaults():
    fp16, _ = ev.recommended_presets(METHOD)
    assert fp16.policy.config() == {
        "budget": 1024,
        "every": None,
        "sketch": 20,
        "local": 16,
        "seed": 0,
    }
    assert fp16.sinks == 4 and fp16.window == 0
    assert METHOD.paper == "https://arxiv.org/abs/2509.15038"


def test_bad_settings_name_the_parameter():
    with pytest.raises(ValueError, match="budget"):
        CurDKVCache(budget=20, sinks=4, window=16)
    with pytest.raises(ValueError, match="local"):
        CurDKVPolicy(budget=10, local=1)
    with pytest.raises(TypeError, match="sketch"):
        CurDKVPolicy(budget=10, sketch=None)
    with pytest.raises(ValueError, match="budget"):
        CurDKVPolicy(budget=0)
