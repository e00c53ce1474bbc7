"""MorphKV: the conformance suite, and what is MorphKV's own."""

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import KVCache

import velox_testing.eviction as ev
from velox_core import VeloxCache, make_cache, routed
from velox_morphkv import METHOD, MorphKVCache, MorphKVPolicy
from velox_testing import tiny_model
from velox_testing.eviction import SCALE, D
from velox_testing.eviction import kept_positions as kept


class TestMorphKV(ev.FullBudgetConformance):
    bad_settings = (
        {"fusion": "mean"},  # the paper's fusions: sum and max
        {"observe": 0},
        {"observe": 2.5},
        {"every": None},  # MorphKV evicts during decode by design
        {"kernel": 7},  # SnapKV's pooling: MorphKV has none
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


class TestMorphKVScoredAgain(ev.Routed, ev.EvictingConformance):
    """The window's queries scored again at every cut (``keep_weights=False``), over 4-bit
    codes and fp16 keys with sinks and a window."""

    def make(self):
        return MorphKVCache(budget=64, bits=4, keep_weights=False)

    def make_precise(self):
        return MorphKVCache(budget=64, sinks=4, window=8, keep_weights=False)


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
@pytest.mark.parametrize("fusion", ["sum", "max"])
def test_scored_again_keeps_the_window_and_the_top_fused_older_tokens_as_algorithm_1(fusion):
    """``keep_weights=False``: a numpy transcription of Algorithm 1 with the paper's weights
    (the prompt held whole and cut at the first decode step by its last ``R`` queries, then
    at every step ``TopC(F_i) ∪ W_i`` before the new token joins, each query head's softmax
    over every held token it sees) against velox's, per KV head, step by step, with GQA."""
    t0, t, budget, window, r = 150, 260, 40, 8, 2
    k, v, q = ev.attention_data(t, r=r, seed=7)
    kn, qn = np.array(k[0]), np.array(q[0])
    c = MorphKVCache(budget=budget, observe=window, fusion=fusion, keep_weights=False)
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


def test_the_two_normalisations_keep_different_tokens():
    """Scored again (``keep_weights=False``), each window query's weights are its softmax over
    the tokens stored at the cut, the window included (the paper's AW_r, equation 1): a query
    that spends its attention on the window counts for little. With the kept weights (the
    authors' code) each is renormalized over the older tokens alone, and the late queries'
    faint choice (token 5) displaces a token the early ones chose."""
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
    caches = [MorphKVCache(budget=budget, observe=window, keep_weights=w) for w in (False, True)]
    for c in caches:
        ev.feed_attending(c, k, v, q, chunk=t, stop=t)
        c.update_and_fetch(k[:, :, t:], v[:, :, t:])
    (ours,) = paper_cut(qn, kn, [set(range(t))], t, budget, window, "sum", 1)
    assert kept(caches[0]) == ours | {t} and set(range(30, 36)) <= ours and 5 not in ours
    older = list(range(t - window))
    alone = fused(qn, kn[0], older, range(t - window, t), "sum")
    authors = set(sorted(older, key=lambda p: -alone[p])[: budget - window])
    assert 5 in authors and kept(caches[1]) == authors | set(range(t - window, t + 1))


def dyadic_data(t, r, seed):
    """``ev.attention_data`` rounded to quarters, flattened (``sharp=0.25``): every logit
    (``q · k / 8`` at ``D = 64``) and every sum of a KV head's logits is exact in float32 and
    in float16, so that the order of the sums and the float16 of the authors' rows do not
    change them."""
    k, v, q = ev.attention_data(t, r=r, seed=seed, sharp=0.25)
    k, q = (mx.round(a * 4) / 4 for a in (k, q))
    return k, v, q


def softmax(x):
    e = np.exp(x - x.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def authors_decode(qn, kn, t0, t, budget, window, fusion, r, scale=SCALE):
    """A numpy transcription of the authors' decode loop (``patch_llama.py``,
    ``LlamaAttentionMorph.forward`` and ``morphkv_mask``, ``MAX_CAPACITY = budget``,
    ``WIN_SIZE = window``): the prompt held whole; ``attn_cache``, the prompt's last ``R``
    queries' logits over it in float16, one row per query head and query, and a ``-inf``
    column for the next token; at each step with ``1 + MAX_CAPACITY`` keys (the new one
    included) the cached rows' logits summed over each KV head's query heads, each row's
    softmax over the keys before the newest ``R + 1``, summed or maxed over the rows, the top
    ``MAX_CAPACITY - R`` and the newest ``R + 1`` kept; then the rows roll, the step's row
    (its logits over the kept keys) joins, and a ``-inf`` column. The authors prune each query
    head's rows by that head's own top-k; here by its KV head's, the keys the rows' columns
    are (the same with one query head a KV head). Yields, after each step, the held
    positions per KV head."""
    h = kn.shape[0]

    def logits(rows, cols, hk):  # (r, len(rows), len(cols)) float16
        qh = qn[hk * r : (hk + 1) * r][:, rows].astype(np.float64)
        return (np.einsum("jnd,md->jnm", qh, kn[hk][cols].astype(np.float64)) * scale).astype(
            np.float16
        )

    def pad(a):
        return np.concatenate([a, np.full((*a.shape[:2], 1), -np.inf, np.float16)], axis=2)

    cols = [list(range(t0)) for _ in range(h)]
    cache = [pad(logits(list(range(t0 - window, t0)), cols[hk], hk)) for hk in range(h)]
    for i in range(t0, t):
        cols = [[*c, i] for c in cols]
        for hk in range(h):
            cur = logits([i], cols[hk], hk)
            if len(cols[hk]) >= budget + 1:
                scores = np.concatenate([cache[hk], cur], axis=1).sum(axis=0)  # float16
                p = softmax(scores[-(window + 1) : -1, : -(window + 1)].astype(np.float64))
                f = p.max(0) if fusion == "max" else p.sum(0)
                top = np.argsort(-f, kind="stable")[: budget - window].tolist()
                keep = sorted(top) + list(range(len(cols[hk]) - window - 1, len(cols[hk])))
                cols[hk] = [cols[hk][j] for j in keep]
                cache[hk], cur = cache[hk][:, :, keep], cur[:, :, keep]
            cache[hk] = pad(np.concatenate([cache[hk][:, 1:], cur], axis=1))
        yield [set(c) for c in cols]


@pytest.mark.parametrize("r", [1, 2])
@pytest.mark.parametrize("fusion", ["sum", "max"])
def test_kept_weights_keep_the_tokens_the_authors_code_keeps(fusion, r):
    """The default (``keep_weights=True``): a numpy transcription of the authors' decode loop
    (:func:`authors_decode`) against velox's, per KV head, step by step; MHA and GQA (their
    logits summed over a KV head's query heads)."""
    t0, t, budget, window = 150, 290, 40, 8
    k, v, q = dyadic_data(t, r, seed=7)
    kn, qn = np.array(k[0]), np.array(q[0])
    summed = np.einsum("hjtd,hsd->hjts", qn.reshape(2, r, t, -1), kn).sum(1) * SCALE
    assert np.abs(summed).max() < 16  # the premise: exact in float16 (multiples of 1 / 128)
    c = MorphKVCache(budget=budget, observe=window, fusion=fusion)
    ev.feed_attending(c, k, v, q, chunk=t0, stop=t0)
    for i, held in zip(range(t0, t), authors_decode(qn, kn, t0, t, budget, window, fusion, r)):
        c.update_and_fetch(k[:, :, i : i + 1], v[:, :, i : i + 1])
        assert c.size() == budget + 1 and [kept(c, h) for h in range(2)] == held, i
        c.attend(q[:, :, i : i + 1], SCALE)
    assert kept(c, 0) != kept(c, 1)  # one selection per KV head
    assert any(p >= t0 for p in range(t0, t - window) if p not in kept(c, 0))  # decode evicted


@pytest.mark.parametrize(
    "settings",
    [{}, {"fusion": "max", "sinks": 4, "window": 8}, {"every": 4}, {"bits": 4, "group": 32}],
)
def test_kept_weights_are_the_softmax_of_the_window_queries_summed_logits(settings):
    """At every step each kept bfloat16 row, over its sum, is the softmax of the newest
    ``observe`` queries' logits over the stored keys (as attention reads them: decoded codes
    with ``bits``) summed over each KV head's query heads, zero for tokens stored after its
    query; then zero columns held for the tokens stored before the next cut. A layer holds
    them and no query."""
    t0, t, budget, observe, r = 120, 300, 48, 16, 4
    k, v, q = ev.attention_data(t, r=r, seed=3, sharp=0.25)
    c = MorphKVCache(budget=budget, observe=observe, **settings)
    ev.feed_attending(c, k, v, q, chunk=60, stop=t0)
    every, qn = settings.get("every", 1), np.array(q[0])
    for i in range(t0, t):
        c.update_and_fetch(k[:, :, i : i + 1], v[:, :, i : i + 1])
        c.attend(q[:, :, i : i + 1], SCALE)
        keys, _ = c.policy_view.keys_and_values()  # (1, 2, S, D)
        pos = np.array([sorted(ev.stored_positions(c, h)) for h in range(2)])  # (2, S)
        rows = np.arange(i + 1 - observe, i + 1)
        qs = qn[:, rows].reshape(2, r, observe, -1).sum(1)  # (2, R, D)
        s = np.einsum("hnd,hsd->hns", qs, np.array(keys[0].astype(mx.float32))) * SCALE
        seen = pos[:, None] <= rows[None, :, None]
        want = softmax(np.where(seen, s, -np.inf))
        weights = c.policy.window.weights
        got = np.array(weights[0].astype(mx.float32))
        n = c.size()
        assert (got[:, :, :n][~seen] == 0).all() and (got[:, :, n:] == 0).all(), i
        got = got[:, :, :n] / got[:, :, :n].sum(-1, keepdims=True)
        np.testing.assert_allclose(got, want, rtol=2e-2, atol=1e-6, err_msg=str(i))
        assert weights.dtype == mx.bfloat16 and n < weights.shape[-1] <= budget + every + 1
    assert c.policy.state().keys() == {"weights"}
    assert c.policy.nbytes == 2 * observe * c.policy.window.weights.shape[-1] * 2


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
    cache = MorphKVCache(budget=budget, observe=window, keep_weights=False)
    model, caches, k0, scale = ev.two_chunk_prompt(cache, budget)  # k0 (H, 256, D)
    survivors = [sorted(kept(caches[0], h)) for h in range(2)]
    qw = np.array(caches[0].policy.window.queries[0].astype(mx.float32))  # (Hq, 16, D)
    assert caches[0].policy.window.end == 256
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


@pytest.mark.parametrize("keep_weights", [True, False])
def test_saved_window_votes_after_loading(tmp_path, keep_weights):
    k, v, q = ev.attention_data(301, seed=8)
    c = MorphKVCache(
        budget=40, observe=16, fusion="max", bits=4, group=32, keep_weights=keep_weights
    )
    ev.feed_attending(c, k, v, q, chunk=150, stop=300)  # the second cut pending
    d = ev.reloaded(c, tmp_path / "c.safetensors")
    # 16 float16 rows over the 190 stored tokens per KV head, or 16 float32 queries per head
    assert d.policy.nbytes == (2 * 16 * 190 * 2 if keep_weights else 4 * 16 * D * 4)
    assert c.policy.nbytes >= d.policy.nbytes  # the columns held for the next tokens not saved
    ev.assert_resumes_alike(c, d, k, v, q)
    assert d.size() == 41


def test_state_in_the_saved_format_loads():
    """A saved cache holds the policy's array "weights" (the window's rows, ``(B, H, n, S)``
    bfloat16) and meta "chunk_pending", "q_end" (the position after the newest query) and
    "covered" (the offset and the stored tokens the columns cover); scored again
    (``keep_weights=False``), "queries" (``(B, Hq, n, D)``) and meta "q_end" and "scale"."""
    k, v, q = ev.attention_data(301, seed=8)
    c = MorphKVCache(budget=40, observe=16)
    ev.feed_attending(c, k, v, q, chunk=150, stop=300)
    weights = c.policy.state()["weights"]  # over the 40 tokens kept and the second chunk
    assert weights.shape == (1, 2, 16, 190) and weights.dtype == mx.bfloat16
    meta = {"chunk_pending": True, "q_end": 300, "covered": [300, 190]}
    d = ev.assert_state_format(c, {"weights": weights}, meta, k[:, :, 300:], v[:, :, 300:])
    assert kept(c) == kept(d) and d.size() == 41
    c = MorphKVCache(budget=40, observe=16, keep_weights=False)
    ev.feed_attending(c, k, v, q, chunk=150, stop=300)
    meta = {"chunk_pending": True, "q_end": 300, "scale": SCALE}
    d = ev.assert_state_format(c, {"queries": q[:, :, 284:300]}, meta, k[:, :, 300:], v[:, :, 300:])
    assert kept(c) == kept(d) and d.size() == 41
    p = MorphKVPolicy(budget=40, observe=16, keep_weights=False)
    assert p.meta() == {"chunk_pending": False, "q_end": 0, "scale": None}
    with pytest.raises(ValueError, match="n <= 16"):
        p.set_state({"queries": q[:, :, :17]}, {"q_end": 17})
    with pytest.raises(ValueError, match="no array state"):
        p.set_state({"queries": q[:, :, :2], "scores": q}, {})
    p = MorphKVPolicy(budget=40, observe=16)
    assert p.meta() == {"chunk_pending": False, "q_end": 0, "covered": None}
    with pytest.raises(ValueError, match="n <= 16"):
        p.set_state({"weights": mx.repeat(weights[:, :, :1], 17, axis=2)}, meta)
    with pytest.raises(ValueError, match="covered"):
        p.set_state({"weights": weights}, {"q_end": 300, "covered": [300, 189]})
    with pytest.raises(ValueError, match="no array state"):
        p.set_state({"weights": weights, "queries": q}, meta)


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
        "keep_weights": True,
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
