"""MorphKV: the conformance suite, and what is MorphKV's own."""

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import KVCache

import velox_testing.eviction as ev
from velox_core import VeloxCache, make_cache, routed
from velox_morphkv import METHOD, MorphKVCache, MorphKVPolicy
from velox_testing import tiny_model
from velox_testing.eviction import kept_positions as kept

D = 64
SCALE = D**-0.5


class TestMorphKV(ev.FullBudgetConformance):
    bad_settings = (
        {"fusion": "mean"},  # the paper's fusions: sum and max
        {"observe": 0},
        {"observe": 2.5},
        {"every": None},  # MorphKV evicts during decode by design
        {"kernel": 7},  # SnapKV's pooling: MorphKV has none
        {"compression_ratio": 0.5},  # kvpress's parameter: velox counts tokens (budget)
        {"keep_weights": 1},
        ({"budget": 32, "observe": 32}, "budget"),  # no older token would fit
        ({"budget": 40, "sinks": 4, "window": 36}, "budget"),
    )

    def make(self):
        return MorphKVCache(budget=4096)


class TestMorphKVEvicting(ev.Routed, ev.EvictingConformance):
    """A small budget, a cut at every decode step and 4-bit codes. The suite fills caches with
    update_and_fetch alone, so every test runs routed (a cut without routing is refused);
    where no query has reached the cache, a cut keeps the newest tokens."""

    def make(self):
        return MorphKVCache(budget=64, bits=4)

    def make_precise(self):
        return MorphKVCache(budget=64)


class TestMorphKVMax(ev.Routed, ev.EvictingConformance):
    """The max fusion, with sinks and a window kept as given."""

    def make(self):
        return MorphKVCache(budget=64, fusion="max", sinks=4, window=8, bits=4)

    def make_precise(self):
        return MorphKVCache(budget=64, fusion="max", sinks=4, window=8)


class TestMorphKVKeptWeights(ev.Routed, ev.EvictingConformance):
    """The window's weights kept from cut to cut (``keep_weights``), over fp16 keys (a decode
    step's weights from its attention) and 4-bit codes (from the decoded keys)."""

    def make(self):
        return MorphKVCache(budget=64, bits=4, keep_weights=True)

    def make_precise(self):
        return MorphKVCache(budget=64, sinks=4, window=8, keep_weights=True)


# -- helpers ---------------------------------------------------------------------------------
def fused(q, keys, held, window, fusion, scale=SCALE):
    """The paper's score ``F_i`` (numpy, float64) for one KV head: each window query's softmax
    weights over the held tokens at or before it (equation 1), its query heads' weights
    averaged (GQA: summed, in the paper; the same order), then summed or maxed over the window
    (equations 5, 6). ``q``: ``(R, T, D)`` the KV head's query heads' queries, ``keys``: ``(T,
    D)``, ``held``: sorted positions; returns ``{position: score}``."""
    held = np.array(held)
    per_query = []
    for w in window:
        s = np.einsum("jd,td->jt", q[:, w], keys[held]) * scale
        s = np.where(held[None] <= w, s, -np.inf)
        p = np.exp(s - s.max(-1, keepdims=True))
        per_query.append((p / p.sum(-1, keepdims=True)).mean(0))
    f = np.max(per_query, axis=0) if fusion == "max" else np.sum(per_query, axis=0)
    return dict(zip(held.tolist(), f.tolist()))


def paper_cut(qn, kn, held, i, budget, window_size, fusion, r):
    """Algorithm 1 at step ``i``, per KV head: ``TopC(F_i) ∪ W_i`` with ``W_i`` the positions
    ``i - R ... i - 1`` and ``C = budget - R``."""
    out = []
    window = list(range(i - window_size, i))
    for h, state in enumerate(held):
        f = fused(qn[h * r : (h + 1) * r], kn[h], sorted(state), window, fusion)
        older = sorted(set(state) - set(window))
        order = sorted(older, key=lambda p: -f[p])
        out.append(set(order[: budget - window_size]) | set(window))
    return out


# -- the mathematics ---------------------------------------------------------------------------
@pytest.mark.parametrize("keep_weights", [False, True])
@pytest.mark.parametrize("fusion", ["sum", "max"])
def test_decode_keeps_the_window_and_the_top_fused_older_tokens_as_algorithm_1(
    fusion, keep_weights
):
    """A numpy transcription of the authors' decode loop (the prompt held whole and cut at the
    first decode step by its last ``R`` queries, then at every step ``TopC(F_i) ∪ W_i`` before
    the new token joins) against velox's, per KV head, step by step, with GQA; the window's
    weights scored again at every cut or kept from cut to cut."""
    t0, t, budget, window, r = 150, 260, 40, 8, 2
    k, v, q = ev.attention_data(t, r=r, seed=7)
    kn, qn = np.array(k[0]), np.array(q[0])
    c = MorphKVCache(budget=budget, observe=window, fusion=fusion, keep_weights=keep_weights)
    ev.feed_attending(c, k, v, q, chunk=t0, stop=t0)
    held = [set(range(t0)) for _ in range(2)]
    for i in range(t0, t):
        if len(held[0]) > budget:
            held = paper_cut(qn, kn, held, i, budget, window, fusion, r)
        held = [s | {i} for s in held]
        c.update_and_fetch(k[:, :, i : i + 1], v[:, :, i : i + 1])
        assert c.size() == budget + 1 and [kept(c, h) for h in range(2)] == held, i
        c.attend(q[:, :, i : i + 1], SCALE)
    assert kept(c, 0) != kept(c, 1)  # one selection per KV head
    assert any(p >= t0 for p in range(t0, t - window) if p not in kept(c, 0))  # decode evicted


def test_sum_and_max_fusions_keep_different_tokens():
    """Sum prefers a token every window query attends to; max a token one query attends to
    strongly (the paper's equations 5 and 6, section 3.1.3)."""
    rng = np.random.default_rng(1)
    t, window = 100, 4
    k = 0.05 * rng.normal(size=(1, 1, t, D))
    q = 0.05 * rng.normal(size=(1, 1, t, D))
    e0, e1 = np.eye(D)[0], np.eye(D)[1]
    k[0, 0, 10] += 10 * e0  # token 10: attended strongly by query 96 alone
    k[0, 0, 20] += 10 * e1  # token 20: attended moderately by every window query
    q[0, 0, 96] += 6 * e0
    q[0, 0, 96:100] += 3.4 * e1
    k, v, q = (mx.array(a.astype(np.float32)) for a in (k, rng.normal(size=k.shape), q))
    f = {
        fusion: fused(np.array(q[0]), np.array(k[0, 0]), range(t), range(96, 100), fusion)
        for fusion in ("sum", "max")
    }
    assert f["sum"][20] > f["sum"][10] and f["max"][10] > f["max"][20]  # the premise
    for fusion, token in (("sum", 20), ("max", 10)):
        c = MorphKVCache(budget=window + 1, observe=window, fusion=fusion)
        ev.feed_attending(c, k, v, q, chunk=t)
        c.update_and_fetch(k[:, :, :1], v[:, :, :1])  # the next step's cut: one older token
        assert kept(c) == {token, 96, 97, 98, 99, 100}, fusion


def test_weights_are_normalized_over_every_token_a_query_sees():
    """Each window query's weights are its softmax over the tokens stored at the cut, the
    window included (the paper's AW_r, equation 1): a query that spends its attention on the
    window counts for little. Renormalized over the older tokens alone (the authors' code),
    the late queries' faint choice (token 5) would displace a token the early ones chose."""
    rng = np.random.default_rng(2)
    t, window = 100, 8
    k = 0.05 * rng.normal(size=(1, 1, t + 1, D))
    q = 0.05 * rng.normal(size=(1, 1, t + 1, D))
    e0, e1, e2 = np.eye(D)[:3]
    k[0, 0, 30:36] += 10 * e1  # the early window queries' choice
    q[0, 0, t - 8 : t - 4] += 4 * e1 - 2 * e2
    k[0, 0, t - 4 : t] += 10 * e0  # the late window queries look at the window itself...
    q[0, 0, t - 4 : t] += 8 * e0 + 2 * e2
    k[0, 0, 5] += 10 * e2  # ... and, faintly, at token 5
    k, v, q = (mx.array(a.astype(np.float32)) for a in (k, rng.normal(size=k.shape), q))
    kn, qn = np.array(k[0]), np.array(q[0])
    budget = window + 7
    c = MorphKVCache(budget=budget, observe=window)
    ev.feed_attending(c, k, v, q, chunk=t, stop=t)
    c.update_and_fetch(k[:, :, t:], v[:, :, t:])
    (ours,) = paper_cut(qn, kn, [set(range(t))], t, budget, window, "sum", 1)
    assert kept(c) == ours | {t} and set(range(30, 36)) <= ours and 5 not in ours
    older = list(range(t - window))
    alone = fused(qn, kn[0], older, range(t - window, t), "sum")
    assert 5 in sorted(older, key=lambda p: -alone[p])[: budget - window]


@pytest.mark.parametrize(
    "settings, per_step, per_cut",
    [
        ({}, 0, 0),  # each step's weights come from its attention
        ({"fusion": "max", "sinks": 4, "window": 8}, 0, 0),
        ({"every": 4}, 0, 0),
        ({"bits": 4, "group": 32}, 1, 0),  # the step's query weighed over the decoded keys
        ({"bits": 4, "group": 32, "window": 8}, 0, 16),  # keys change leaving the window
    ],
)
@pytest.mark.parametrize("dtype", [mx.float32, mx.float16])
def test_kept_weights_keep_the_tokens_that_scoring_the_window_again_keeps(
    settings, per_step, per_cut, dtype, monkeypatch
):
    """keep_weights (the window's weights kept from cut to cut, renormalized over the tokens
    left) keeps, at every step and in every KV head, the tokens that scoring the window's
    queries against the stored keys at every cut keeps; over keys stored as given a decode
    step scores no query beside its attention."""
    import velox_core.policy.window as window

    scored = []

    def counting(queries, *args):
        scored.append(queries.shape[2])
        return weights(queries, *args)

    weights = window.window_weights
    monkeypatch.setattr(window, "window_weights", counting)
    t0, t, budget, observe = 120, 360, 48, 16
    k, v, q = (a.astype(dtype) for a in ev.attention_data(t, r=4, seed=3))
    caches = [
        MorphKVCache(budget=budget, observe=observe, keep_weights=keep, **settings)
        for keep in (True, False)
    ]
    for c in caches:
        ev.feed_attending(c, k, v, q, chunk=60, stop=t0)
    for i in range(t0, t):
        counts = []
        for c in caches:
            scored.clear()
            c.update_and_fetch(k[:, :, i : i + 1], v[:, :, i : i + 1])
            cut = c.size() == budget + 1
            c.attend(q[:, :, i : i + 1], SCALE)
            counts.append(sum(scored))
        assert [ev.stored_positions(caches[0], h) for h in range(2)] == [
            ev.stored_positions(caches[1], h) for h in range(2)
        ], i
        if i > t0 + 8:  # past the first decode cut (a cut after the prompt scores it)
            assert counts == [per_step + per_cut * cut, observe * cut], i
    # the window's queries, and with keep_weights their float32 weights over the stored tokens
    # and the zero columns held for the next ones (dropped, with coded keys leaving the
    # window, until a cut scores them again)
    rolled, scratch = (c.policy.nbytes for c in caches)
    queries = 4 * 2 * observe * D * dtype.size
    assert scratch == queries
    if per_cut:
        assert rolled == queries
    else:
        cols = caches[0].policy.window.weights.shape[-1]
        assert caches[0].size() < cols <= caches[0].size() + settings.get("every", 1) + 1
        assert rolled == queries + 4 * 2 * observe * cols * 4


# -- the behaviour -----------------------------------------------------------------------------
def test_memory_stays_within_the_budget_over_3000_decode_steps():
    """The issue's target: a long response never holds more than ``budget`` tokens plus the
    new one, so resident bytes stop growing once the budget is full; generated tokens are
    evicted along with the prompt's."""
    k, v, q = ev.attention_data(3300, seed=2)
    budget, prompt = 128, 200
    c = MorphKVCache(budget=budget)
    ev.feed_attending(c, k, v, q, chunk=prompt, stop=prompt)
    sizes, nbytes = set(), set()
    for i in range(prompt, 3300):
        c.update_and_fetch(k[:, :, i : i + 1], v[:, :, i : i + 1])
        c.attend(q[:, :, i : i + 1], SCALE)
        sizes.add(c.size())
        if i > prompt + 64:
            nbytes.add(c.nbytes)
    assert sizes == {budget + 1} and c.offset == 3300
    assert len(nbytes) == 1  # 3,000+ steps at one resident size
    full = KVCache()  # the same float32 tokens, every one kept
    full.update_and_fetch(k, v)
    assert c.nbytes < full.nbytes / 15  # 129 of 3,300 tokens, plus the window's 32 queries
    assert min(kept(c)) < prompt and len([p for p in kept(c) if p >= 3300 - 32]) == 32


def test_a_tiny_model_decodes_3000_tokens_within_the_budget():
    """Through mlx-lm's own loop (``generate_step``, routed): every layer at ``budget + 1``
    tokens after every step, the offset the absolute count of tokens seen."""
    from mlx_lm.generate import generate_step

    model = tiny_model("llama")
    caches = make_cache(model, MorphKVCache(budget=96, observe=16))
    prompt = mx.random.randint(0, 512, (300,), key=mx.random.key(3))
    sizes = set()
    with routed(model):
        for n, _ in enumerate(generate_step(prompt, model, prompt_cache=caches, max_tokens=3000)):
            if n % 100 == 0:
                sizes.update(c.size() for c in caches)
    assert sizes == {97} and all(c.offset == 3300 for c in caches)


def test_layer_zero_of_a_tiny_model_keeps_what_the_window_votes_for_and_stays_bounded():
    """Routed, chunked prefill then decode: bounded at budget + a chunk, then budget + 1 at
    every step. At layer 0 (keys and queries do not depend on the cache) the first decode
    step's cut keeps the top of the last chunk's window over the survivors, as numpy says."""
    budget, window = 64, 16
    cache = MorphKVCache(budget=budget, observe=window)
    model, caches, k0, scale = ev.two_chunk_prompt(cache, budget)  # k0 (H, 256, D)
    survivors = [sorted(kept(caches[0], h)) for h in range(2)]
    qw = np.array(caches[0].policy._queries[0].astype(mx.float32))  # (Hq, 16, D)
    assert caches[0].policy._q_end == 256
    with routed(model):
        for step in ev.decode_bounded(model, caches, range(7, 13), budget + 1):
            if step == 0:
                r = qw.shape[0] // 2
                for h in range(2):
                    qh = np.zeros((r, 256, qw.shape[-1]), dtype=np.float32)
                    qh[:, 240:] = qw[h * r : (h + 1) * r]
                    f = fused(qh, k0[h], survivors[h], range(240, 256), "sum", scale)
                    older = [p for p in survivors[h] if p < 240]
                    top = set(sorted(older, key=lambda p: -f[p])[: budget - window])
                    assert kept(caches[0], h) == top | set(range(240, 257)), h
    assert all(c.offset == 262 for c in caches)


def test_prefill_prompt_holds_the_prompt_and_cuts_once_as_the_authors():
    """``prefill="prompt"``: chunks accumulate (the whole prompt held, as in the authors'
    cache) and the first decode step cuts it, voted by the prompt's last ``observe`` queries:
    the same tokens as a prompt in one chunk."""
    t, budget = 300, 48
    k, v, q = ev.attention_data(t + 1, seed=4)
    one = MorphKVCache(budget=budget)
    ev.feed_attending(one, k, v, q, chunk=t, stop=t)
    chunked = MorphKVCache(budget=budget, prefill="prompt")
    ev.feed_attending(chunked, k, v, q, chunk=100, stop=t)
    assert chunked.size() == t
    for c in (one, chunked):
        c.update_and_fetch(k[:, :, t:], v[:, :, t:])
    assert [kept(chunked, h) for h in range(2)] == [kept(one, h) for h in range(2)]
    eager = MorphKVCache(budget=budget)  # prefill="chunks": a cut after each chunk
    ev.feed_attending(eager, k, v, q, chunk=100, stop=t)
    assert eager.size() == budget + 100


def test_coarse_grained_eviction_cuts_every_n_steps():
    """``every=8`` (the paper's appendix A.5): the cache grows to ``budget + 8``, then is cut
    back to ``budget`` by the latest window."""
    k, v, q = ev.attention_data(200, seed=6)
    c = MorphKVCache(budget=40, every=8)
    ev.feed_attending(c, k, v, q, chunk=100, stop=100)
    sizes = ev.decode_attending(c, k, v, q, 100, 130)
    assert max(sizes) == 48 and min(sizes) == 41 and sizes[:3] == [41, 42, 43]


def test_sinks_window_and_codes_compose():
    """Sinks and the window are kept as given; the recent window (``observe``) is kept within
    the body; the older tokens are voted on from the stored codes."""
    k, v, q = ev.attention_data(301, seed=5)
    c = ev.composed_cache(MorphKVPolicy(budget=44, observe=16), k, v, q)
    assert c.size() == 45
    assert c.body_sizes() == [33, 33] and set(range(284, 293)) <= kept(c, 0)


def test_without_queries_the_cut_is_refused_unless_routed():
    c, _, _ = ev.assert_cut_needs_routing(lambda: MorphKVCache(budget=40), t=300, d=D)
    # routed, where no query reached the cache: the newest tokens
    assert kept(c, 0) == kept(c, 1) == set(range(259, 300))


def test_tokens_no_query_has_seen_are_kept():
    k, v, q = ev.attention_data(200, seed=6)
    c = MorphKVCache(budget=48, observe=8)
    ev.feed_attending(c, k, v, q, chunk=100, stop=100)
    c.update_and_fetch(k[:, :, 100:130], v[:, :, 100:130])  # cut by 92..99; 100..129 unseen
    c.update_and_fetch(k[:, :, 130:131], v[:, :, 130:131])  # cut: no query has seen 100..129
    assert set(range(100, 131)) <= kept(c, 0) and c.size() == 49


def test_saved_window_votes_after_loading(tmp_path):
    k, v, q = ev.attention_data(301, seed=8)
    c = MorphKVCache(budget=40, observe=16, fusion="max", bits=4, group=32)
    ev.feed_attending(c, k, v, q, chunk=150, stop=300)  # the second cut pending
    d = ev.reloaded(c, tmp_path / "c.safetensors")
    assert d.policy.nbytes == c.policy.nbytes == 4 * 16 * D * 4  # 16 float32 queries per head
    ev.assert_resumes_alike(c, d, k, v, q)
    assert d.size() == 41


def test_state_in_the_saved_format_loads():
    """A saved cache holds the policy's array "queries" (the window, ``(B, Hq, n, D)``) and
    meta "chunk_pending", "q_end" (the position after the newest query) and "scale"."""
    k, v, q = ev.attention_data(301, seed=8)
    c = MorphKVCache(budget=40, observe=16)
    ev.feed_attending(c, k, v, q, chunk=150, stop=300)
    meta = {"chunk_pending": True, "q_end": 300, "scale": SCALE}
    d = ev.assert_state_format(c, {"queries": q[:, :, 284:300]}, meta, k[:, :, 300:], v[:, :, 300:])
    assert kept(c) == kept(d) and d.size() == 41
    p = MorphKVPolicy(budget=40, observe=16)
    assert p.meta() == {"chunk_pending": False, "q_end": 0, "scale": None}
    with pytest.raises(ValueError, match="n <= 16"):
        p.set_state({"queries": q[:, :, :17]}, {"q_end": 17})
    with pytest.raises(ValueError, match="no array state"):
        p.set_state({"queries": q[:, :, :2], "scores": q}, {})


def test_batch_rows_keep_their_own_window():
    rows = ev.attention_data(201, seed=9), ev.attention_data(201, seed=10)
    ev.batch_rows_apart(lambda: MorphKVCache(budget=24, observe=8), rows, 200)


def test_output_attends_only_to_kept_tokens():
    """After the cut, attention equals fp16 attention over exactly the kept tokens (each KV
    head its own)."""
    k, v, q = ev.attention_data(201, seed=12, r=1)
    c = MorphKVCache(budget=30, observe=8)
    ev.feed_attending(c, k, v, q, chunk=200, stop=200)
    c.update_and_fetch(k[:, :, 200:], v[:, :, 200:])
    ev.assert_attends_to(c, q[:, :, 200:], k, v, lambda h: kept(c, h), SCALE)


def test_recommended_settings_and_defaults():
    fp16, _ = ev.recommended_presets(METHOD)
    assert fp16.policy.config() == {
        "budget": 1024,
        "every": 1,
        "observe": 32,
        "fusion": "sum",
        "keep_weights": False,
    }
    assert fp16.sinks == fp16.window == 0 and fp16.config()["prefill"] == "chunks"
    assert METHOD.paper == "https://arxiv.org/abs/2503.00979"


def test_bad_settings_name_the_parameter():
    with pytest.raises(ValueError, match="every=None"):
        MorphKVCache(every=None)
    with pytest.raises(ValueError, match="every=None"):
        MorphKVPolicy(budget=64, every=None)
    with pytest.raises(ValueError, match="fusion"):
        MorphKVCache(fusion="avg")
    with pytest.raises(ValueError, match="fusion"):
        MorphKVPolicy(budget=64, fusion="min")
    with pytest.raises(TypeError, match="observe"):
        MorphKVCache(observe=True)
    with pytest.raises(ValueError, match="observe"):
        MorphKVPolicy(budget=64, observe=0)
    with pytest.raises(ValueError, match=r"max\(window, observe\)"):
        MorphKVCache(budget=32)  # observe=32 by default
    with pytest.raises(ValueError, match=r"max\(window, observe\)"):
        VeloxCache(policy=MorphKVPolicy(budget=20, observe=16), sinks=4)
    with pytest.raises(ValueError, match="prefill"):
        MorphKVCache(prefill="once")
    with pytest.raises(TypeError, match="keep_weights"):
        MorphKVCache(keep_weights="yes")
    with pytest.raises(TypeError, match="keep_weights"):
        MorphKVPolicy(budget=64, keep_weights=None)
