"""SnapKV: the conformance suite, and what is SnapKV's own."""

import math

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import QuantizedKVCache

import velox_testing.eviction as ev
import velox_testing.references as refs
from velox_core import Uniform, VeloxCache, load_cache, make, make_cache, routed, save_cache
from velox_snapkv import METHOD, SnapKVCache, SnapKVPolicy, pool_votes, window_votes
from velox_testing import kv_data, rel_error, tiny_model
from velox_testing.eviction import kept_positions as kept

D = 64
SCALE = D**-0.5


class TestSnapKV(ev.FullBudgetConformance):
    bad_settings = (*ev.VOTE_BAD, {"kernel": 0}, {"observe": 8.0})

    def make(self):
        return SnapKVCache(budget=4096)


class TestSnapKVEvicting(ev.Routed, ev.EvictingConformance):
    """A small budget, decode cuts and 4-bit codes: evicting, lossy, bounded. The suite fills
    caches with update_and_fetch alone, so every test runs routed (a cut without routing is
    refused); where no query has reached the cache, a cut keeps the most recent tokens."""

    def make(self):
        return SnapKVCache(budget=64, observe=8, every=8, bits=4)

    def make_precise(self):
        return SnapKVCache(budget=64, observe=8, every=8)


class TestSnapKVPromptPrefill(ev.Routed, ev.EvictingConformance):
    """``prefill="prompt"``: the prompt's chunks held and cut once at its end; batching
    (merge, filter, extend), saving and decode cuts as with per-chunk cuts."""

    # the memory check feeds 512-token chunks and no decode token: the whole prompt is held,
    # in 4-bit codes (0.29x fp16 with scales and positions)
    max_memory_ratio = 0.3

    def make(self):
        return SnapKVCache(budget=64, observe=8, every=8, bits=4, prefill="prompt")

    def make_precise(self):
        return SnapKVCache(budget=64, observe=8, every=8, prefill="prompt")


# -- helpers ---------------------------------------------------------------------------------
def planted(t, strong, h=2, r=2, seed=0, amp=8.0, noise=0.3, sign=1.0):
    """Keys, values and queries in which every query of KV head ``i``'s group points along a
    direction ``u_i`` and the keys at positions ``strong[i]`` are ``amp * u_i``: the queries
    attend to those positions (softmax weight ~e^8 against ~e^0 for the others).

    Returns float32 ``k, v`` ``(1, h, t, D)``, ``q`` ``(1, h * r, t, D)`` and ``u`` ``(h, D)``.
    """
    rng = np.random.default_rng(seed)
    u = rng.normal(size=(h, D))
    u /= np.linalg.norm(u, axis=1, keepdims=True)
    k = rng.normal(0, 0.5, (1, h, t, D))
    for i, ps in strong.items():
        k[0, i, ps] = amp * u[i]
    v = rng.normal(size=(1, h, t, D))
    q = sign * amp * np.repeat(u, r, axis=0)[None, :, None] + noise * rng.normal(
        size=(1, h * r, t, D)
    )
    k, v, q = (mx.array(a.astype(np.float32)) for a in (k, v, q))
    return k, v, q, u


def next_token(cache, seed=9):
    """One more (decode) token: its update runs the cut that follows a prefill chunk."""
    h = cache.stored.dims[1]
    k, v = (mx.random.normal((1, h, 1, D), key=mx.random.key(seed + i)) for i in (0, 1))
    cache.update_and_fetch(k, v)


# -- the mathematics ---------------------------------------------------------------------------
def test_votes_are_the_window_softmax_summed_and_averaged_over_each_group():
    rng = np.random.default_rng(3)
    h, r, n, t = 2, 3, 5, 40
    q = rng.normal(size=(1, h * r, n, D))
    k = rng.normal(size=(1, h, t, D))
    k_pos = np.sort(rng.choice(100, size=t, replace=False))
    q_pos = np.array([60, 61, 70, 90, 99])
    got = window_votes(mx.array(q), mx.array(q_pos), mx.array(k), mx.array(k_pos)[None, None], 0.3)
    ref = np.zeros((h, t))
    for hq in range(h * r):
        for i in range(n):
            s = 0.3 * k[0, hq // r] @ q[0, hq, i]
            s[k_pos > q_pos[i]] = -np.inf  # causal: a query sees positions up to its own
            p = np.exp(s - s.max())
            ref[hq // r] += p / p.sum() / r
    assert np.allclose(np.array(got[0]), ref, atol=1e-5)
    # GQA: the votes of a KV head are the mean of its query heads' votes
    heads = [
        window_votes(
            mx.array(q[:, j : j + 1]),
            mx.array(q_pos),
            mx.array(k[:, j // r : j // r + 1]),
            mx.array(k_pos)[None, None],
            0.3,
        )
        for j in range(h * r)
    ]
    for i in range(h):
        mean = sum(np.array(heads[i * r + j]) for j in range(r)) / r
        assert np.allclose(np.array(got[:, i : i + 1]), mean, atol=1e-6)


@pytest.mark.parametrize("pooling", ["max", "avg"])
@pytest.mark.parametrize("kernel", [1, 3, 7])
def test_pooling_is_pool1d_on_a_contiguous_prefix(kernel, pooling):
    votes = np.random.default_rng(kernel).random(50).astype(np.float32)
    candidate = np.arange(50) < 42  # the last 8 are the observation window: they do not pool
    got = pool_votes(
        mx.array(votes)[None, None],
        mx.arange(100, 150)[None, None],
        mx.array(candidate)[None, None],
        kernel,
        pooling,
    )
    ref = refs.pool1d_reference(np.where(candidate, votes, 0), kernel, pooling)
    assert np.allclose(np.array(got[0, 0, :42]), ref[:42], atol=1e-6)


def test_pooling_neighbours_are_by_position_not_by_slot():
    """After a cut, slots 1 and 2 hold positions 11 and 50: they are not neighbours."""
    pos = mx.array([10, 11, 50, 51, 52])[None, None]
    votes = mx.array([0.0, 0.0, 9.0, 0.0, 1.0])[None, None]
    everyone = mx.ones(pos.shape, dtype=mx.bool_)
    got = np.array(pool_votes(votes, pos, everyone, 3, "max")[0, 0])
    assert got.tolist() == [0.0, 0.0, 9.0, 9.0, 1.0]
    got = np.array(pool_votes(votes, pos, everyone, 3, "avg")[0, 0])
    assert np.allclose(got, [0.0, 0.0, 3.0, 10 / 3, 1 / 3])


@pytest.mark.parametrize("pooling", ["avg", "max"])
def test_a_prompt_in_one_chunk_gets_exactly_the_papers_rule(pooling):
    """The whole prompt at once, then the cut: the kept tokens are those of the paper's
    update_kv (softmax of the window's queries over the whole prompt, summed over the window,
    averaged over each KV head's query heads, pooled, top budget - window, plus the window)."""
    t, h, r, window, budget, kernel = 300, 2, 2, 16, 80, 7
    k, v = kv_data(h=h, t=t + 1, d=D, seed=5, dtype=mx.float32)
    q = mx.random.normal((1, h * r, t, D), key=mx.random.key(5)) + k[:, :1, -2:-1] / 4
    c = SnapKVCache(budget=budget, observe=window, kernel=kernel, pooling=pooling)
    ev.feed_attending(c, k[:, :, :t], v[:, :, :t], q, chunk=t)
    c.update_and_fetch(k[:, :, t:], v[:, :, t:])
    # the paper's rule (numpy)
    votes = refs.window_votes_reference(k, q, t, window, SCALE)[:, : t - window]
    for i in range(h):
        pooled = refs.pool1d_reference(votes[i], kernel, pooling)
        top = np.argsort(-pooled, kind="stable")[: budget - window]
        got = kept(c, i, below=t)
        assert set(range(t - window, t)) <= got and len(got) == budget
        prefix = sorted(got - set(range(t - window, t)))
        if pooling == "avg":  # no ties: the same tokens
            assert set(prefix) == set(top.tolist())
        else:  # max pooling ties neighbours: the same pooled scores
            assert np.allclose(np.sort(pooled[prefix]), np.sort(pooled[top]), rtol=1e-4)


def test_prefill_prompt_cuts_a_chunked_prompt_once_at_its_end_as_in_one_chunk():
    """``prefill="prompt"``: a prompt fed in 64-token chunks keeps every token until the first
    decode token, then keeps exactly what the same prompt fed at once keeps (the paper's rule,
    above); the default cuts after each chunk, voted by that chunk's own last queries."""
    t, h, r, window, budget = 300, 2, 2, 16, 80
    k, v = kv_data(h=h, t=t + 1, d=D, seed=5, dtype=mx.float32)
    q = mx.random.normal((1, h * r, t, D), key=mx.random.key(5)) + k[:, :1, -2:-1] / 4
    caches = {}
    for name, chunk, prefill in (
        ("once", t, "chunks"),
        ("prompt", 64, "prompt"),
        ("chunks", 64, "chunks"),
    ):
        c = SnapKVCache(budget=budget, observe=window, kernel=7, prefill=prefill)
        sizes = ev.feed_attending(c, k[:, :, :t], v[:, :, :t], q, chunk=chunk)
        if name == "prompt":
            assert sizes == [64, 128, 192, 256, 300]  # nothing cut during the prompt
        c.update_and_fetch(k[:, :, t:], v[:, :, t:])
        assert c.size() == budget + 1
        caches[name] = c
    for i in range(h):
        assert kept(caches["prompt"], i) == kept(caches["once"], i)
    assert any(kept(caches["chunks"], i) != kept(caches["once"], i) for i in range(h))


def test_prefill_setting_is_checked_and_saved(tmp_path):
    with pytest.raises(ValueError, match="prefill"):
        make_cache(tiny_model("llama"), "snapkv:budget=64,prefill=whole")
    c = make("snapkv:budget=80,observe=16,prefill=prompt")
    assert c.policy.prefill == "prompt"
    k, v = kv_data(h=2, t=100, d=D, seed=1, dtype=mx.float32)
    q = mx.random.normal((1, 2, 100, D), key=mx.random.key(1))
    ev.feed_attending(c, k, v, q, chunk=50)
    save_cache(str(tmp_path / "c.safetensors"), [c])
    (back,) = load_cache(str(tmp_path / "c.safetensors"))
    assert back.policy.prefill == "prompt" and back.size() == 100
    for x in (c, back):
        next_token(x)
        assert x.size() == 81
    assert kept(back, 0) == kept(c, 0)


# -- the behaviour -----------------------------------------------------------------------------
def test_positions_the_window_attends_to_are_kept_per_head():
    strong = {0: [40, 150, 260], 1: [90, 333]}
    k, v, q, _ = planted(401, strong)
    c = SnapKVCache(budget=40, observe=16, kernel=1)
    ev.feed_attending(c, k, v, q, chunk=400, stop=400)
    c.update_and_fetch(k[:, :, 400:], v[:, :, 400:])
    for i, ps in strong.items():
        got = kept(c, i, below=400)
        assert set(ps) <= got and set(range(384, 400)) <= got and len(got) == 40
    # each head votes on its own: head 1's strong tokens are not head 0's
    assert not {90, 333} <= kept(c, 0) or not {40, 150, 260} <= kept(c, 1)


@pytest.mark.parametrize("pooling", ["max", "avg"])
def test_pooling_keeps_the_neighbours_of_a_strong_position(pooling):
    k, v, q, _ = planted(301, {0: [150], 1: [150]}, seed=1)
    prefix = {}
    for kernel in (1, 5):
        c = SnapKVCache(budget=21, observe=16, kernel=kernel, pooling=pooling)
        ev.feed_attending(c, k, v, q, chunk=300, stop=300)
        c.update_and_fetch(k[:, :, 300:], v[:, :, 300:])
        prefix[kernel] = kept(c, 0, below=284)  # the 5 voted prompt tokens
    assert prefix[5] == {148, 149, 150, 151, 152}
    assert 150 in prefix[1] and prefix[1] != prefix[5]


def test_gqa_keeps_what_any_query_head_of_the_group_attends_to():
    """KV head 0 is shared by query heads 0 and 1, which look at different tokens."""
    rng = np.random.default_rng(2)
    t = 301
    k = rng.normal(0, 0.5, (1, 2, t, D))
    u = rng.normal(size=(3, D))
    u /= np.linalg.norm(u, axis=1, keepdims=True)
    k[0, 0, 70], k[0, 0, 210], k[0, 1, 120] = 8 * u[0], 8 * u[1], 8 * u[2]
    q = 0.3 * rng.normal(size=(1, 4, t, D))
    q[0, 0] += 8 * u[0]  # query head 0 -> position 70 of KV head 0
    q[0, 1] += 8 * u[1]  # query head 1 -> position 210 of KV head 0
    q[0, 2:] += 8 * u[2]  # query heads 2, 3 -> position 120 of KV head 1
    k, v, q = (mx.array(a.astype(np.float32)) for a in (k, rng.normal(size=k.shape), q))
    c = SnapKVCache(budget=20, observe=16, kernel=1)
    ev.feed_attending(c, k, v, q, chunk=300, stop=300)
    c.update_and_fetch(k[:, :, 300:], v[:, :, 300:])
    assert {70, 210} <= kept(c, 0) and 120 in kept(c, 1)


def test_the_observation_window_is_never_evicted():
    """Window tokens whose keys point away from every query still stay, at every cut."""
    k, v, q, u = planted(600, {0: [100, 200], 1: [150]}, seed=4)
    k = np.array(k)
    k[0, :, 300:] = -8 * u[:, None]  # no query attends to any token from 300 on
    k = mx.array(k)
    c = SnapKVCache(budget=40, observe=12, kernel=3, every=4)
    for s in range(0, 600, 50):  # chunks, then every later chunk starts with a cut
        ev.feed_attending(
            c, k[:, :, s : s + 50], v[:, :, s : s + 50], q[:, :, s : s + 50], chunk=50
        )
        if s:
            for i in range(2):
                assert set(range(s - 12, s)) <= kept(c, i), s
    for i in range(2):
        assert set(range(600 - 12, 600)) <= kept(c, i)
    next_token(c)
    assert set(range(588, 601)) <= kept(c, 0) and c.size() == 41


@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_decode_cuts_vote_with_the_latest_decode_queries(sign):
    """Token 199 ends the prompt's window, so the prompt cut keeps it; at the decode cuts
    (every 8 steps) it is outside the window and stays only if the decode queries look at it."""
    k, v, q, _ = planted(240, {0: [199], 1: [199]}, seed=6, sign=sign)
    q = mx.concatenate(
        [0.3 * mx.random.normal((1, 4, 200, D), key=mx.random.key(1)), q[:, :, 200:]], 2
    )
    c = SnapKVCache(budget=48, observe=8, kernel=1, every=8)
    ev.feed_attending(c, k, v, q, chunk=200, stop=200)
    sizes = ev.decode_attending(c, k, v, q, 200, 201)
    assert 199 in kept(c, 0)  # the prompt cut
    sizes += ev.decode_attending(c, k, v, q, 201, 240)
    assert max(sizes) <= 48 + 8 and c.offset == 240
    assert (199 in kept(c, 0) and 199 in kept(c, 1)) == (sign > 0)


def test_the_same_token_keeps_its_rotated_key_through_evictions():
    k, v, q, _ = planted(500, {0: [30, 220], 1: [120]}, seed=7)
    exact = SnapKVCache(budget=64, observe=8, kernel=3)
    coded = VeloxCache(Uniform(8), Uniform(8), policy=SnapKVPolicy(budget=64, observe=8, kernel=3))
    before = {}
    for s in range(0, 500, 100):
        ev.feed_attending(
            exact, k[:, :, s : s + 100], v[:, :, s : s + 100], q[:, :, s : s + 100], 100
        )
        for i, keys in enumerate(coded.policy_view.body_keys() if coded.offset else []):
            for j, p in enumerate(np.array(coded.policy_view.body_positions()[i][0]).tolist()):
                before[(i, p)] = np.array(keys[0, 0, j])
        ev.feed_attending(
            coded, k[:, :, s : s + 100], v[:, :, s : s + 100], q[:, :, s : s + 100], 100
        )
        kk, _ = exact.keys_and_values()
        for i in range(2):
            pos = mx.array(exact.policy_view.body_positions()[i][0])
            assert mx.array_equal(kk[:, i, : pos.size], k[:, i, pos])  # the original keys
        for i, keys in enumerate(coded.policy_view.body_keys()):
            for j, p in enumerate(np.array(coded.policy_view.body_positions()[i][0]).tolist()):
                if (i, p) in before:  # decoded after the cut = decoded before it
                    assert np.array_equal(np.array(keys[0, 0, j]), before[(i, p)])
    assert exact.offset == coded.offset == 500 and exact.size() <= 164


def test_chunked_prefill_in_a_tiny_model_is_bounded_and_keeps_absolute_offsets():
    model = tiny_model("llama")
    prompt = mx.random.randint(0, 512, (1, 300), key=mx.random.key(0))
    budget, chunk = 96, 64
    caches = make_cache(model, SnapKVCache(budget=budget, observe=16))
    full = make_cache(model, VeloxCache())  # no policy: every token stays
    per_token = 2 * (64 + 64) * 2 + 2 * 4  # fp16 keys and values of 2 KV heads, int32 positions
    with routed(model):
        for s in ev.prefill_checked(model, caches, prompt, chunk):
            model(prompt[:, s : s + chunk], cache=full)
            mx.eval([c.state for c in full])
            for c in caches:
                assert c.size() <= budget + chunk
                # budget + one chunk of tokens, plus the observation window's fp16 queries
                assert c.nbytes <= 1.05 * (budget + chunk) * per_token + 16 * 4 * 64 * 2
        model(prompt[:, -1:], cache=caches)
    assert all(c.offset == 301 for c in caches) and all(c.size() == budget + 1 for c in caches)
    assert all(c.policy.nbytes == 0 for c in caches)  # no decode cuts: no queries kept
    assert all(max(kept(c, 0)) == 300 for c in caches)
    assert (
        min(c.nbytes for c in full) >= 300 * 2 * (64 + 64) * 2 > 2 * max(c.nbytes for c in caches)
    )


def test_composes_with_uniform_codes_sinks_and_a_window(tmp_path):
    k, v, q, _ = planted(401, {0: [50, 180], 1: [260]}, seed=8)
    c = VeloxCache(
        Uniform(4), Uniform(4), sinks=4, window=8, policy=SnapKVPolicy(budget=48, observe=16)
    )
    ev.feed_attending(c, k, v, q, chunk=128, stop=400)
    c.update_and_fetch(k[:, :, 400:], v[:, :, 400:])
    kk, _ = c.keys_and_values()
    assert mx.array_equal(kk[:, :, :4], k[:, :, :4])  # the sinks, as given
    assert c.size() == 49 and sum(c.body_sizes()) // 2 == 49 - 4 - 8
    assert {50, 180} <= kept(c, 0) and 260 in kept(c, 1)
    assert set(range(384, 392)) <= kept(c, 0)  # the window beyond the fp16 one
    d = ev.reloaded(c, tmp_path / "c.safetensors")
    qq = q[:, :, 400:]
    assert mx.array_equal(d.attend(qq, SCALE), c.attend(qq, SCALE))


def _mlx_q4(x):
    w, s, z = mx.quantize(x, group_size=64, bits=4)
    return mx.dequantize(w, s, z, group_size=64, bits=4)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_four_bit_setting_against_mlx_q4(seed):
    """The 4-bit setting (``budget=1024, bits=4, group=32``) fed 1,281 tokens of kv_data
    (prefill in 512-token chunks whose queries vote, then a decode token) holds fewer bytes
    than mlx-lm's QuantizedKVCache(64, 4) fed the same tokens, and its attention error (the 256
    evicted tokens included) is no worse than that of mlx's 4-bit group-64 codes of every token; so
    is the error its codes add to the tokens it keeps. (Measured on seeds 0-9: total 0.11 to
    0.30 against mlx's 0.12 to 0.39; far more eviction on kv_data, whose tokens are i.i.d.,
    costs more than 4-bit codes do.)"""
    t, d = 1280, 128
    k, v = kv_data(t=t + 1, d=d, seed=seed)
    scale = 1 / math.sqrt(d)

    def queries(n, key):  # as the suite's attention test: random, plus a shared direction
        q = mx.random.normal((1, 4, n, d), key=mx.random.key(key)) + k[:, :1, -1:] / 4
        return q.astype(mx.float16)

    ours = SnapKVCache(budget=1024, bits=4, group=32)
    theirs = QuantizedKVCache(group_size=64, bits=4)
    for s in range(0, t, 512):
        e = min(s + 512, t)
        for c in (ours, theirs):
            c.update_and_fetch(k[:, :, s:e], v[:, :, s:e])
        ours.attend(queries(e - s, s), scale, mask="causal")
    for c in (ours, theirs):
        c.update_and_fetch(k[:, :, t:], v[:, :, t:])
    mx.eval(ours.state, theirs.state)
    assert ours.size() == 1025 and ours.nbytes <= theirs.nbytes, (ours.nbytes, theirs.nbytes)
    q = queries(16, 1000 + seed)
    sdpa = mx.fast.scaled_dot_product_attention
    mlx = rel_error(sdpa(q, _mlx_q4(k), _mlx_q4(v), scale=scale), sdpa(q, k, v, scale=scale))
    # fp16 attention over the tokens the 4-bit cache kept, per KV head
    refs = []
    for i, p in enumerate(ours.policy_view.body_positions()):
        kept_k, kept_v = k[:, i : i + 1, p[0]], v[:, i : i + 1, p[0]]
        refs.append(sdpa(q[:, 2 * i : 2 * i + 2], kept_k, kept_v, scale=scale))
    out = ours.attend(q, scale)
    assert rel_error(out, sdpa(q, k, v, scale=scale)) <= mlx
    assert rel_error(out, mx.concatenate(refs, axis=1)) <= mlx


@pytest.mark.parametrize("bits", [None, 4])
def test_memory_follows_the_packed_layout(bits):
    """Per kept token and KV head: keys, values and an int32 position (docs/snapkv.md)."""
    k, v = kv_data(t=301, d=128)
    c = SnapKVCache(budget=64, observe=8, **({} if bits is None else {"bits": bits, "group": 32}))
    with routed():  # no query reaches the cache: the cut keeps the newest tokens
        c.update_and_fetch(k[:, :, :300], v[:, :, :300])
        c.update_and_fetch(k[:, :, 300:], v[:, :, 300:])  # the cut, then one more token
    mx.eval(c.state)
    per_token = 516 if bits is None else 2 * (64 + 4 * 128 // 32) + 4
    assert c.size() == 65 and c.logical_nbytes == 65 * 2 * per_token
    assert c.nbytes >= c.logical_nbytes and c.policy.nbytes == 0


def test_without_observed_queries_the_cut_is_refused_unless_routed():
    """Attention not routed: no query can reach the policy, and the cut raises rather than
    evict by recency behind the user's back. Routed, before any query has reached the cache
    (update_and_fetch alone), the cut keeps the newest tokens."""
    k, v = kv_data(t=300, d=D)
    c = SnapKVCache(budget=40, observe=8)
    c.update_and_fetch(k[:, :, :299], v[:, :, :299])
    with pytest.raises(ValueError, match="routed"):
        c.update_and_fetch(k[:, :, 299:], v[:, :, 299:])
    c = SnapKVCache(budget=40, observe=8)
    with routed():
        c.update_and_fetch(k[:, :, :299], v[:, :, :299])
        c.update_and_fetch(k[:, :, 299:], v[:, :, 299:])
    assert kept(c, 0) == kept(c, 1) == set(range(259, 300))


def test_small_chunks_fill_the_window_and_trimmed_queries_leave_it():
    k, v, q, _ = planted(100, {0: [10], 1: [10]})
    c = SnapKVCache(budget=90, observe=16)
    ev.feed_attending(c, k, v, q, chunk=5, stop=40)
    assert c.policy.window.end == 40 and mx.array_equal(c.policy.window.queries, q[:, :, 24:40])
    c.trim(3)  # e.g. rejected draft tokens: positions 37..39 are gone
    ev.feed_attending(c, k[:, :, 37:39], v[:, :, 37:39], q[:, :, 37:39], chunk=2)
    # 24..36 survive the trim (23 had already left the window), then 37 and 38
    assert c.policy.window.end == 39 and mx.array_equal(c.policy.window.queries, q[:, :, 24:39])
    assert c.policy.nbytes == 15 * 4 * D * 4 and c.nbytes > c.policy.nbytes


def test_saved_queries_vote_after_loading(tmp_path):
    k, v, q, _ = planted(301, {0: [77], 1: [140]}, seed=10)
    c = SnapKVCache(budget=32, observe=8, every=16)
    ev.feed_attending(c, k, v, q, chunk=150, stop=300)  # the second cut pending
    d = ev.reloaded(c, tmp_path / "c.safetensors")
    ev.assert_resumes_alike(c, d, k, v, q)
    assert 77 in kept(d, 0) and 140 in kept(d, 1)


def test_batch_rows_keep_their_own_votes():
    k0, v0, q0, _ = planted(301, {0: [60], 1: [60]}, seed=11)
    k1, v1, q1, _ = planted(301, {0: [230], 1: [230]}, seed=12)
    k, v, q = (mx.concatenate(p, axis=0) for p in ((k0, k1), (v0, v1), (q0, q1)))
    c = SnapKVCache(budget=24, observe=8, kernel=1, every=4)
    ev.feed_attending(c, k, v, q, chunk=300, stop=300)
    one = c.extract(1)
    for x in (c, one):
        x.update_and_fetch(k[-x.stored.dims[0] :, :, 300:], v[-x.stored.dims[0] :, :, 300:])
    pos = np.array(mx.stack(c.policy_view.body_positions(), axis=1))
    assert 60 in pos[0, 0] and 230 in pos[1, 0] and 60 not in pos[1, 0]
    assert kept(one, 0) == set(pos[1, 0].tolist())


def test_recommended_settings():
    fp16, eight = ev.recommended_presets(METHOD, voted=True)
    assert fp16.policy.budget == eight.policy.budget == 1024
    assert fp16.policy.config() == eight.policy.config()
    assert fp16.policy.config() == {
        "budget": 1024,
        "every": None,
        "observe": 32,
        "kernel": 15,
        "pooling": "max",
    }


def test_bad_policy_settings():
    ev.assert_vote_settings_refused(SnapKVPolicy)


def test_state_in_the_saved_format_loads():
    """A saved cache holds the policy's array "queries" (the newest ``observe`` queries) and
    meta "chunk_pending", "q_end" (the position after them) and "scale": state written by
    hand in that format votes as the policy's own."""
    k, v, q, _ = planted(301, {0: [77], 1: [140]}, seed=10)
    c = SnapKVCache(budget=32, observe=8, every=16)
    ev.feed_attending(c, k, v, q, chunk=150, stop=300)  # the second cut pending
    meta = {"chunk_pending": True, "q_end": 300, "scale": SCALE}
    d = ev.assert_state_format(c, {"queries": q[:, :, 292:300]}, meta, k[:, :, 300:], v[:, :, 300:])
    assert kept(c, 0) == kept(d, 0) and kept(c, 1) == kept(d, 1)
    assert 77 in kept(d, 0) and 140 in kept(d, 1)
    p = SnapKVPolicy(budget=32, observe=8)
    p.set_state({}, {"chunk_pending": False, "q_end": 12, "scale": None})  # nothing kept
    assert p.state() == {} and p.meta() == {"chunk_pending": False, "q_end": 12, "scale": None}
    with pytest.raises(ValueError, match="queries"):
        p.set_state({"queries": q[:, :, :9]}, {"q_end": 9, "scale": SCALE})  # 9 > observe
    with pytest.raises(ValueError, match="array state"):
        p.set_state({"queries": q[:, :, :8], "query": q[:, :, :1]}, {})
