"""TOVA: the conformance suite, and what is TOVA's own."""

import mlx.core as mx
import numpy as np
import pytest

import velox_testing.eviction as ev
from velox_core import Uniform, VeloxCache, routed
from velox_testing.eviction import SCALE, D
from velox_testing.eviction import kept_positions as kept
from velox_tova import METHOD, TOVACache, TOVAPolicy


class TestTOVA(ev.FullBudgetConformance):
    spec = "tova:budget=4096"
    bad_settings = (
        {"observe": 1},  # the last query alone scores: no window to set
        ({"budget": 12, "sinks": 4, "window": 8}, "budget"),
    )


class TestTOVAEvicting(ev.Routed, ev.EvictingConformance):
    """A small budget, the paper's eviction at every decode step and 4-bit codes. The suite
    fills caches with update_and_fetch alone, so every test runs routed (a cut without
    routing is refused); where no query has reached the cache, a cut keeps the newest tokens."""

    spec = "tova:budget=64,bits=4"
    precise_spec = "tova:budget=64"


# -- helpers ---------------------------------------------------------------------------------
def head_mean_weights(q, keys, scale=SCALE):
    """The paper's score (numpy, float64): the softmax weights of one query ``(Hq, D)`` over
    keys ``(H, T, D)`` (query head ``j`` reads KV head ``j // (Hq / H)``), averaged over
    the query heads: ``(T,)``."""
    hq, h = q.shape[0], keys.shape[0]
    s = np.einsum("jd,jtd->jt", q, np.repeat(keys, hq // h, axis=0)) * scale
    p = np.exp(s - s.max(-1, keepdims=True))
    return (p / p.sum(-1, keepdims=True)).mean(0)


def top(scores, n, among):
    among = np.array(sorted(among))
    return set(among[np.argsort(-scores, kind="stable")[:n]].tolist())


# -- the mathematics ---------------------------------------------------------------------------
@pytest.mark.parametrize("r", [1, 3])
def test_a_prompt_in_one_chunk_keeps_what_the_last_query_attends_to_most(r):
    """The paper's reduce after the prompt: the last prompt query's softmax weights over the
    prompt, averaged over all query heads (GQA included), top ``budget``: one set, every head."""
    t, budget = 300, 48
    k, v, q = ev.attention_data(t + 1, r=r, seed=r)
    c = TOVACache(budget=budget)
    ev.feed_attending(c, k, v, q, chunk=t, stop=t)
    c.update_and_fetch(k[:, :, t:], v[:, :, t:])  # the cut, then one more token
    w = head_mean_weights(np.array(q[0, :, t - 1]), np.array(k[0, :, :t]))
    ref = top(w, budget, range(t))
    assert kept(c, 0) - {t} == ref and kept(c, 1) == kept(c, 0)
    assert c.size() == budget + 1
    # a per-KV-head selection (each head on its own query heads) would keep other tokens
    own = [
        head_mean_weights(np.array(q[0, i * r : (i + 1) * r, t - 1]), np.array(k[0, i : i + 1, :t]))
        for i in range(2)
    ]
    assert any(top(own[i], budget, range(t)) != ref for i in range(2))


def test_decode_evicts_one_token_per_step_as_the_papers_cache():
    """A numpy transcription of the authors' cache (append the token, attend, and if over
    ``budget`` drop the lowest head-averaged weight of that step's query, which may be the
    new token itself) against velox's, step by step: the same tokens, at every step."""
    t0, t, budget = 120, 220, 40
    k, v, q = ev.attention_data(t, r=2, seed=7)
    kn, qn = np.array(k[0]), np.array(q[0])
    # the paper: the prompt, reduced with its last query, then one token per step
    state = top(head_mean_weights(qn[:, t0 - 1], kn[:, :t0]), budget, range(t0))
    c = TOVACache(budget=budget)
    ev.feed_attending(c, k, v, q, chunk=t0, stop=t0)
    for i in range(t0, t):
        c.update_and_fetch(k[:, :, i : i + 1], v[:, :, i : i + 1])
        assert c.size() == budget + 1 and kept(c, 0) == kept(c, 1) == state | {i}, i
        c.attend(q[:, :, i : i + 1], SCALE)
        held = sorted(state | {i})
        w = head_mean_weights(qn[:, i], kn[:, held])
        state = set(held) - {held[int(np.argmin(w))]}
    c.update_and_fetch(k[:, :, -1:], v[:, :, -1:])  # the last step's cut
    assert kept(c, 0) - {t} == state


def test_the_newest_token_can_be_evicted_unless_the_window_keeps_it():
    """In the paper the token just stored competes too (kvpress always keeps it: window=1)."""
    k, v, q = ev.attention_data(101, seed=3)
    k = np.array(k)
    k[0, :, 100] = -20.0 * np.array(q[0, ::2, 100])  # the newest key points away from the query
    k = mx.array(k)
    for window, kept_newest in ((0, False), (1, True)):
        c = TOVACache(budget=32, window=window)
        ev.feed_attending(c, k, v, q, chunk=100, stop=100)
        c.update_and_fetch(k[:, :, 100:], v[:, :, 100:])
        c.attend(q[:, :, 100:], SCALE)
        c.update_and_fetch(k[:, :, :1], v[:, :, :1])  # the next step: its cut drops one token
        positions = kept(c, 0) | set(range(c.offset - window, c.offset))
        assert (100 in positions) == kept_newest, window


def test_one_query_head_can_outvote_the_rest_and_every_kv_head_keeps_its_choice():
    """Head averaging (the paper): token 30 gets weight ~1 from query head 0 alone; tokens
    that every query head weighs evenly get less on average. Every KV head keeps 30, KV head
    1 too, though none of its query heads looks at it."""
    rng = np.random.default_rng(4)
    t = 101
    k = 0.1 * rng.normal(size=(1, 2, t, D))
    q = 0.1 * rng.normal(size=(1, 4, t, D))
    u = np.eye(D)[0]
    k[0, 0, 30] = 12 * u
    q[0, 0, 99] += 12 * u  # query head 0 (of KV head 0) -> token 30
    k, v, q = (mx.array(a.astype(np.float32)) for a in (k, rng.normal(size=k.shape), q))
    c = TOVACache(budget=8)
    ev.feed_attending(c, k, v, q, chunk=100, stop=100)
    c.update_and_fetch(k[:, :, 100:], v[:, :, 100:])
    assert 30 in kept(c, 0) and 30 in kept(c, 1) and kept(c, 0) == kept(c, 1)


def test_sinks_window_and_codes_compose():
    """Sinks and window are kept as given; the body is cut by the softmax weights over every
    stored token (sinks and window in the normalization, which weighs the heads' average),
    read from the stored codes."""
    t = 301
    k, v, q = ev.attention_data(t, seed=5)
    k = np.array(k)
    k[0, 0, :4] = 0.5 * np.array(q[0, 0, 299])  # KV head 0's query heads look at the sinks
    k = mx.array(k)
    c = VeloxCache(Uniform(8), Uniform(8), sinks=4, window=8, policy=TOVAPolicy(budget=44))
    ev.feed_attending(c, k, v, q, chunk=128, stop=300)
    body = sorted(kept(c))  # what the last chunk's cut will choose from
    stored, _ = c.keys_and_values()  # sinks | body | window, decoded from the codes
    w = head_mean_weights(np.array(q[0, :, 299]), np.array(stored[0].astype(mx.float32)))
    ref = top(w[4 : 4 + len(body)], 32, body)  # budget - sinks - window
    # normalized over the body alone, the heads would weigh otherwise and keep other tokens
    alone = stored[0, :, 4 : 4 + len(body)].astype(mx.float32)
    assert top(head_mean_weights(np.array(q[0, :, 299]), np.array(alone)), 32, body) != ref
    c.update_and_fetch(k[:, :, 300:], v[:, :, 300:])
    kk, _ = c.keys_and_values()
    assert mx.array_equal(kk[:, :, :4], k[:, :, :4]) and c.size() == 45
    assert mx.array_equal(kk[:, :, -8:], k[:, :, 293:301])
    assert c.body_sizes() == [33, 33] and kept(c, 0) == kept(c, 1) == ref | {292}


# -- the behaviour -----------------------------------------------------------------------------
def test_layer_zero_of_a_tiny_model_keeps_the_last_querys_choice_and_stays_bounded():
    """Routed, chunked prefill then decode: bounded at budget + a chunk, then budget + 1 at
    every step. At layer 0 (keys and queries do not depend on the cache) the prompt's last
    cut keeps the top of the last chunk's last query over the survivors, as numpy says."""
    budget = 64
    model, caches, k0, scale = ev.two_chunk_prompt(TOVACache(budget=budget), budget)
    survivors = sorted(kept(caches[0]))  # the first cut's survivors, then the chunk
    q = np.array(caches[0].policy._query[0, :, 0].astype(mx.float32))  # query 255
    with routed(model):
        for step in ev.decode_bounded(model, caches, range(7, 13), budget + 1):
            assert all(kept(c, 0) == kept(c, 1) for c in caches)
            if step == 0:
                w = head_mean_weights(q, k0[:, survivors], scale)
                assert kept(caches[0]) - {256} == top(w, budget, survivors)
    assert all(c.offset == 262 for c in caches)


def test_without_queries_the_cut_is_refused_unless_routed():
    c, _, _ = ev.assert_cut_needs_routing(lambda: TOVACache(budget=40), t=300, d=D)
    # routed, where no query reached the cache: the newest tokens
    assert kept(c, 0) == kept(c, 1) == set(range(259, 300))


def test_tokens_no_query_has_seen_are_kept_and_a_trimmed_query_is_dropped():
    k, v, q = ev.attention_data(200, seed=6)
    c = TOVACache(budget=40)
    ev.feed_attending(c, k, v, q, chunk=100, stop=100)
    c.update_and_fetch(k[:, :, 100:130], v[:, :, 100:130])  # cut by query 99; 100..129 unseen
    c.update_and_fetch(k[:, :, 130:131], v[:, :, 130:131])  # cut: query 99 sees none of them
    assert set(range(100, 131)) <= kept(c, 0) and c.size() == 41
    ev.feed_attending(c, k[:, :, 131:160], v[:, :, 131:160], q[:, :, 131:160], chunk=29)
    assert c.policy._q_pos == 159
    c.trim(5)  # e.g. rejected draft tokens: the query's own token is gone
    with routed():
        c.update_and_fetch(k[:, :, 155:157], v[:, :, 155:157])
        c.update_and_fetch(k[:, :, 157:158], v[:, :, 157:158])  # no valid query: recency
    assert kept(c, 0) == set(range(157 - 40, 158))  # the newest 40, then token 157


def test_saved_query_scores_after_loading(tmp_path):
    k, v, q = ev.attention_data(301, seed=8)
    c = TOVACache(budget=32, bits=4, group=32)
    ev.feed_attending(c, k, v, q, chunk=150, stop=300)  # the second cut pending
    d = ev.reloaded(c, tmp_path / "c.safetensors")
    assert d.policy.nbytes == c.policy.nbytes == 4 * D * 4  # one float32 query per head
    ev.assert_resumes_alike(c, d, k, v, q)
    assert d.size() == 33


def test_batch_rows_keep_their_own_query():
    rows = ev.attention_data(201, seed=9), ev.attention_data(201, seed=10)
    ev.batch_rows_apart(lambda: TOVACache(budget=24), rows, 200)


def test_decode_state_is_one_query_and_none_without_every():
    k, v, q = ev.attention_data(120, seed=11)
    for every, nbytes in ((1, 4 * D * 4), (None, 0)):
        c = TOVACache(budget=32, every=every)
        ev.feed_attending(c, k, v, q, chunk=100, stop=100)
        for i in range(100, 120):
            c.update_and_fetch(k[:, :, i : i + 1], v[:, :, i : i + 1])
            c.attend(q[:, :, i : i + 1], SCALE)
        assert c.policy.nbytes == nbytes
        assert c.size() == (33 if every else 52)  # every=None: decode tokens accumulate


def test_recommended_settings_and_defaults():
    fp16, _ = ev.recommended_presets(METHOD)
    assert fp16.policy.config() == {"budget": 1024, "every": 1}
    assert fp16.sinks == fp16.window == 0
    assert METHOD.paper == "https://arxiv.org/abs/2401.06104"


def test_the_policy_refuses_a_negative_every():
    with pytest.raises(ValueError, match="every"):
        TOVAPolicy(budget=8, every=-1)


def test_output_attends_only_to_kept_tokens():
    """After the cut, attention equals fp16 attention over exactly the kept tokens."""
    k, v, q = ev.attention_data(201, seed=12)
    c = TOVACache(budget=30)
    ev.feed_attending(c, k, v, q, chunk=200, stop=200)
    c.update_and_fetch(k[:, :, 200:], v[:, :, 200:])
    ev.assert_attends_to(c, q[:, :, 200:], k, v, lambda h: kept(c), SCALE)  # one set, every head


def test_state_in_the_saved_format_loads():
    """A saved cache holds the policy's array "query" (the last query, ``(B, Hq, 1, D)``) and
    meta "chunk_pending", "q_pos" (its position) and "scale": state written by hand in that
    format scores as the policy's own."""
    k, v, q = ev.attention_data(301, seed=8)
    c = TOVACache(budget=32)
    ev.feed_attending(c, k, v, q, chunk=150, stop=300)  # the second cut pending
    meta = {"chunk_pending": True, "q_pos": 299, "scale": SCALE}
    d = ev.assert_state_format(c, {"query": q[:, :, 299:300]}, meta, k[:, :, 300:], v[:, :, 300:])
    assert kept(c) == kept(d) and d.size() == 33
    p = TOVAPolicy(budget=32)
    assert p.meta() == {"chunk_pending": False, "q_pos": -1, "scale": None}
    p.set_state({}, {"q_pos": 40, "scale": 0.5})
    assert p.state() == {} and p.meta() == {"chunk_pending": False, "q_pos": 40, "scale": 0.5}
    with pytest.raises(ValueError, match=r"\(B, Hq, 1, D\)"):
        p.set_state({"query": q[:, :, :2]}, {"q_pos": 1})
