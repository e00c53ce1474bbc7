"""H2O: the conformance suite, and what is H2O's own."""

import mlx.core as mx
import numpy as np
import pytest

import velox_core.policy.accumulated as accumulated
import velox_h2o.policy as h2o_policy
import velox_testing.eviction as ev
import velox_testing.references as refs
from velox_core import VeloxCache, make, make_cache, routed
from velox_h2o import METHOD, H2OCache, H2OConfig, H2OPolicy
from velox_testing import tiny_model
from velox_testing.eviction import SCALE, D
from velox_testing.eviction import stored_positions as stored


class TestH2O(ev.FullBudgetConformance):
    # fp16 tokens (512 B a token and KV head at head dim 128), the body's int32 positions and
    # H2O's float32 accumulated score: 520 B
    max_memory_ratio = 1.02
    spec = "h2o:budget=4096"
    bad_settings = (
        *ev.RECENT_BAD,
        ({"budget": 64, "sinks": 4, "recent": 60}, "recent"),  # no heavy hitter would fit
        {"heavy_ratio": 0.1},  # the authors' simulation flag: velox counts tokens (budget)
    )


class TestH2OEvicting(ev.Routed, ev.EvictingConformance):
    """A small budget, the paper's eviction at every decode step and 4-bit codes. The suite
    fills caches with update_and_fetch alone, so every test runs routed (a cut of tokens no
    query has seen is refused otherwise); where no query has reached the cache, a cut keeps
    the newest tokens."""

    spec = "h2o:budget=64,bits=4"
    precise_spec = "h2o:budget=64"


# -- helpers ---------------------------------------------------------------------------------
class PaperH2O(refs.ScoreReference):
    """The authors' cache (``h2o_hf/utils_real_drop``, ``H2OKVCache_LayerWise``) transcribed
    in numpy, float64: per KV head the kept positions and their accumulated scores. A call
    stores its tokens (score 0), attends causally with its queries and adds each query's
    softmax weights (GQA: the mean over the KV head's query heads); then, once over
    ``budget``, it keeps the ``recent`` newest tokens and the top ``budget - recent`` of the
    others by score.

    ``last_query_only``: a control that does not accumulate (each call's last query alone
    scores, as TOVA's rule per head), for the tests to tell the two apart."""

    def __init__(self, k, q, budget, recent, last_query_only=False, scale=SCALE):
        super().__init__(k, q)
        self.budget, self.recent = budget, recent
        self.last_query_only = last_query_only
        self.scale = scale

    def attend(self, s, e):
        self.store(s, e)
        for h in range(self.h):
            if self.last_query_only:
                self.score[h][:] = 0.0
            for i in range(e - 1 if self.last_query_only else s, e):
                seen, w = self.weights(h, i, self.scale)
                self.score[h][seen] += w

    def reduce(self, offset):
        self.keep_heavy(self.budget, self.recent, offset)

    def call(self, s, e):
        self.attend(s, e)
        self.reduce(e)


def assert_scores(cache, ref):
    """velox's accumulated scores (storage order: by position) equal the transcription's."""
    got = np.array(cache.policy._scores[0])
    for h in range(ref.h):
        assert sorted(stored(cache, h)) == ref.pos[h].tolist(), h
        assert np.allclose(got[h], ref.score[h], rtol=1e-4, atol=1e-6), h


def run_both(k, v, q, t0, budget, recent, chunk, **kw):
    """velox and the transcription side by side over a prompt of ``t0`` tokens (in chunks
    of ``chunk``), then one decode step per remaining token: the same tokens stored and the
    same scores at every step. Returns the transcription."""
    t = k.shape[2]
    c = H2OCache(budget=budget, recent=recent, **kw)
    ref = PaperH2O(k, q, budget, recent)
    for s, e in [(s, min(s + chunk, t0)) for s in range(0, t0, chunk)] + [
        (i, i + 1) for i in range(t0, t)
    ]:
        c.update_and_fetch(k[:, :, s:e], v[:, :, s:e])  # velox cuts here (the pending cut)
        for h in range(ref.h):
            assert stored(c, h) == ref.kept(h) | set(range(s, e)), (s, h)
        assert c.size() == max(len(ref.pos[h]) for h in range(ref.h)) + e - s
        c.attend(q[:, :, s:e], SCALE, mask="causal" if e - s > 1 else None)
        ref.attend(s, e)
        assert_scores(c, ref)
        ref.reduce(e)
    c.update_and_fetch(k[:, :, :1], v[:, :, :1])  # the last step's cut
    for h in range(ref.h):
        assert stored(c, h) - {t} == ref.kept(h), h
    return ref


# -- the mathematics ---------------------------------------------------------------------------
@pytest.mark.parametrize("r", [1, 3])
def test_a_prompt_in_one_chunk_then_decode_keeps_what_the_papers_cache_keeps(r):
    """The paper's rule step by step: the prompt's accumulated attention (every prompt query)
    reduces it to budget, then each decode step adds its query's weights and drops the
    lowest-scored token outside the recent window. MHA (r=1) and GQA (r=3)."""
    k, v, q = ev.attention_data(260, r=r, seed=r)
    ref = run_both(k, v, q, t0=200, budget=48, recent=24, chunk=200)
    # the heads chose differently: each KV head keeps its own heavy hitters
    assert ref.kept(0) != ref.kept(1)
    # accumulation matters: the last query alone (no accumulation) keeps other tokens
    tova = PaperH2O(k, q, 48, 24, last_query_only=True)
    for s, e in [(0, 200)] + [(i, i + 1) for i in range(200, 260)]:
        tova.call(s, e)
    assert any(tova.kept(h) != ref.kept(h) for h in range(2))


def test_chunked_prefill_cuts_after_each_chunk_with_the_scores_so_far():
    """A prompt in chunks: each chunk attends the earlier survivors plus itself, adds to the
    scores, and the next update cuts back to budget (peak: budget plus one chunk)."""
    k, v, q = ev.attention_data(330, seed=7)
    run_both(k, v, q, t0=300, budget=40, recent=8, chunk=64)
    # the prompt in one chunk keeps other tokens (a token dropped early cannot return)
    one, chunked = PaperH2O(k, q, 40, 8), PaperH2O(k, q, 40, 8)
    one.call(0, 300)
    for s in range(0, 300, 64):
        chunked.call(s, min(s + 64, 300))
    assert any(one.kept(h) != chunked.kept(h) for h in range(2))


def test_scores_accumulate_over_decode_steps():
    """The decode queries' weights add to the prompt's: without them (the prompt's scores
    alone), the decode evictions would drop other tokens."""
    k, v, q = ev.attention_data(300, seed=6)
    ref = run_both(k, v, q, t0=200, budget=32, recent=8, chunk=100)
    frozen = PaperH2O(k, q, 32, 8)
    frozen.call(0, 100)
    frozen.call(100, 200)
    for i in range(200, 300):  # store, score 0, no weights added, reduce
        for h in range(2):
            frozen.pos[h] = np.append(frozen.pos[h], i)
            frozen.score[h] = np.append(frozen.score[h], 0.0)
        frozen.reduce(i + 1)
    assert any(frozen.kept(h) != ref.kept(h) for h in range(2))


def test_the_recent_window_is_always_kept_and_the_budget_honoured():
    """Recent tokens stay whatever their scores (keys pointing away from every query), the
    heavy hitters fill the rest, and the cache never holds more than budget + 1 in decode."""
    k, v, q = ev.attention_data(200, seed=8)
    k, u = np.array(k), np.array(q).mean(axis=(0, 1, 2))
    k[0, :, 100:] = -2.0 * u  # decode tokens point away from every query: ~0 attention
    k = mx.array(k)
    budget, recent = 32, 12
    c = H2OCache(budget=budget, recent=recent)
    ev.feed_attending(c, k, v, q, chunk=100, stop=100)
    for i in range(100, 200):
        c.update_and_fetch(k[:, :, i : i + 1], v[:, :, i : i + 1])
        assert c.size() == budget + 1 and c.nbytes > 0
        for h in range(2):
            held = stored(c, h)
            assert set(range(i - recent, i + 1)) <= held, (i, h)
        c.attend(q[:, :, i : i + 1], SCALE)
    # the heavy hitters are prompt tokens: the dropped tokens were the weak decode ones
    assert all(len({p for p in stored(c, h) if p < 100}) == budget - recent for h in range(2))
    assert c.policy._scores.shape == (1, 2, budget + 1)  # the scores leave with their tokens


def test_sinks_window_and_codes_compose():
    """Sinks and window are kept as given; the window counts among the recent tokens; the
    weights are normalized over every stored token, read from the stored codes."""
    k, v, q = ev.attention_data(301, seed=5)
    c = ev.composed_cache(H2OPolicy(budget=44, recent=16), k, v, q)
    assert c.size() == 45
    assert c.body_sizes() == [33, 33]
    for h in range(2):
        held = stored(c, h)
        assert set(range(4)) | set(range(300 - 16, 301)) <= held
        assert len(held - set(range(4)) - set(range(284, 301))) == 44 - 4 - 16
    # hand-composed with a recent window that leaves no heavy hitter: refused by name
    with pytest.raises(ValueError, match="recent"):
        VeloxCache(sinks=4, policy=H2OPolicy(budget=20, recent=16))


def test_a_long_chunk_is_scored_in_blocks_of_queries(monkeypatch):
    """A prefill chunk's weights are formed a block of queries at a time (at most
    SCORE_ELEMENTS weights), and the sum is the same as in one block."""
    k, v, q = ev.attention_data(300, seed=14)
    whole = H2OCache(budget=64)
    ev.feed_attending(whole, k, v, q, chunk=300)
    blocks = []
    votes = accumulated.window_votes  # H2O's votes (AttentionVotes.votes)

    def counted(queries, *rest):
        blocks.append(queries.shape[2])
        return votes(queries, *rest)

    monkeypatch.setattr(h2o_policy, "SCORE_ELEMENTS", 4 * 300 * 32)  # 4 query heads, 300 keys
    monkeypatch.setattr(accumulated, "window_votes", counted)
    split = H2OCache(budget=64)
    ev.feed_attending(split, k, v, q, chunk=300)
    assert blocks == [32] * 9 + [12]
    a, b = np.array(whole.policy._scores), np.array(split.policy._scores)
    assert np.allclose(a, b, rtol=1e-5, atol=1e-7)


# -- the behaviour -----------------------------------------------------------------------------
def test_layer_zero_of_a_tiny_model_matches_the_transcription():
    """Routed, chunked prefill then decode in a real mlx-lm model: at layer 0 (its keys and
    queries do not depend on the cache) velox keeps what the transcription keeps, fed the
    layer's own keys and queries, and every layer stays at budget + 1 in decode."""
    model = tiny_model("llama")
    prompt = mx.random.randint(0, 512, (1, 256), key=mx.random.key(0))
    steps = [7, 11, 13, 17, 19, 23]
    budget, recent, chunk = 64, 16, 128
    caches = make_cache(model, H2OCache(budget=budget, recent=recent))
    k0, _, q0 = ev.observed_layer_zero(model, caches, prompt, steps, chunk, size=budget + 1)
    ref = PaperH2O(k0, q0, budget, recent, scale=model.layers[0].self_attn.scale)
    for s, e in [(0, 128), (128, 256)] + [(i, i + 1) for i in range(256, 261)]:
        ref.call(s, e)
    for h in range(k0.shape[1]):
        assert stored(caches[0], h) - {261} == ref.kept(h), h
    assert all(c.offset == 262 for c in caches)


def test_without_queries_the_cut_is_refused_unless_routed():
    c, _, _ = ev.assert_cut_needs_routing(lambda: H2OCache(budget=40), t=300, d=D)
    # routed, where no query reached the cache: the newest tokens
    assert stored(c, 0) == stored(c, 1) == set(range(259, 300))


def test_a_trim_takes_the_scores_of_the_trimmed_tokens():
    """Trimmed tokens (rejected draft tokens, say) leave with their scores; tokens stored
    again at those positions start from zero and score with their own queries. The weights
    the trimmed queries gave older tokens stay on them (``is_trimmable()`` is False)."""
    k, v, q = ev.attention_data(165, seed=9)
    k2, v2, q2 = ev.attention_data(165, seed=15)  # what is stored after the trim
    c = H2OCache(budget=400)
    ev.feed_attending(c, k, v, q, chunk=80, stop=160)
    assert not c.is_trimmable()
    c.trim(5)
    ev.feed_attending(c, k2[:, :, 155:], v2[:, :, 155:], q2[:, :, 155:], chunk=5)
    ref = PaperH2O(k, q, 400, 200)
    ref.attend(0, 80)
    ref.attend(80, 160)
    for h in range(2):
        ref.pos[h], ref.score[h] = ref.pos[h][:155], ref.score[h][:155]
    ref.k[:, 155:], ref.q[:, 155:] = np.array(k2[0, :, 155:]), np.array(q2[0, :, 155:])
    ref.attend(155, 160)
    ref.attend(160, 165)
    assert_scores(c, ref)
    # evicting, and tokens stored again without attention: unseen, kept first
    c = H2OCache(budget=40, recent=10)
    ev.feed_attending(c, k, v, q, chunk=80, stop=160)
    with routed():
        c.trim(3)
        c.update_and_fetch(k[:, :, 157:159], v[:, :, 157:159])
        c.update_and_fetch(k[:, :, 159:160], v[:, :, 159:160])
    assert {157, 158, 159} <= stored(c, 0) and c.size() == 41
    assert c.policy._scores.shape == (1, 2, 41)


def test_saved_scores_choose_after_loading(tmp_path):
    k, v, q = ev.attention_data(301, seed=8)
    c = H2OCache(budget=32, bits=4, group=32)
    ev.feed_attending(c, k, v, q, chunk=150, stop=300)  # the second cut pending
    d = ev.reloaded(c, tmp_path / "c.safetensors")
    assert d.policy.nbytes == c.policy.nbytes == 4 * 2 * c.size()  # a float32 per token, head
    assert d.policy.meta() == c.policy.meta() == {"chunk_pending": True, "seen": 300}
    ev.assert_resumes_alike(c, d, k, v, q)
    assert d.size() == 33
    assert np.array_equal(np.array(c.policy._scores), np.array(d.policy._scores))


def test_state_in_the_saved_format_and_bad_state():
    """The policy's array is "scores" (float32 ``(B, H, S)``), its meta "chunk_pending" and
    "seen"; scores that disagree with the stored tokens are refused at the next update."""
    k, v, q = ev.attention_data(120, seed=3)
    c = H2OCache(budget=32)
    ev.feed_attending(c, k, v, q, chunk=100, stop=100)
    assert set(c.policy.state()) == {"scores"}
    p = H2OPolicy(budget=32, recent=8)
    assert p.meta() == {"chunk_pending": False, "seen": 0} and p.state() == {}
    with pytest.raises(ValueError, match=r"float32 \(B, H, S\)"):
        p.set_state({"scores": mx.zeros((2, 100))}, {})
    with pytest.raises(ValueError, match=r"float32 \(B, H, S\)"):
        p.set_state({"scores": mx.zeros((1, 2, 100), dtype=mx.float16)}, {})
    d = c.copy()
    d.policy.set_state({"scores": mx.zeros((1, 2, 90))}, c.policy.meta())
    with pytest.raises(ValueError, match="scores cover 90 tokens"):
        d.update_and_fetch(k[:, :, 100:101], v[:, :, 100:101])


def test_batch_rows_keep_their_own_scores():
    rows = ev.attention_data(201, seed=10), ev.attention_data(201, seed=11)
    _, one, alone = ev.batch_rows_apart(lambda: H2OCache(budget=24), rows, 100, stored)
    both = alone.copy()
    both.extend(one)
    assert both.policy._scores.shape == (2, 2, 25)


@pytest.mark.filterwarnings("ignore:h2o. budget=32 bounds the prompt only")
def test_every_sets_the_cadence_and_none_keeps_decode_tokens():
    k, v, q = ev.attention_data(140, seed=12)
    for every, size in ((1, 33), (8, 32 + 8), (None, 72)):
        c = H2OCache(budget=32, every=every)
        ev.feed_attending(c, k, v, q, chunk=100, stop=100)
        for i in range(100, 140):
            c.update_and_fetch(k[:, :, i : i + 1], v[:, :, i : i + 1])
            assert c.size() <= 32 + (every or 40), (every, i)
            c.attend(q[:, :, i : i + 1], SCALE)
        assert c.size() == size, every
        assert c.policy._scores.shape[2] == size  # decode queries still accumulate


def test_output_attends_only_to_kept_tokens():
    """After the cut, attention equals fp16 attention over exactly the kept tokens (each KV
    head its own)."""
    k, v, q = ev.attention_data(201, seed=13)
    c = H2OCache(budget=30)
    ev.feed_attending(c, k, v, q, chunk=200, stop=200)
    c.update_and_fetch(k[:, :, 200:], v[:, :, 200:])
    ev.assert_attends_to(c, q[:, :, 200:], k, v, lambda h: stored(c, h), SCALE)


def test_recommended_settings_defaults_and_split():
    fp16, _ = ev.recommended_presets(METHOD)
    assert fp16.policy.config() == {"budget": 1024, "every": 1, "recent": 512}
    assert fp16.sinks == fp16.window == 0
    assert METHOD.paper == "https://arxiv.org/abs/2306.14048"
    assert make("h2o:budget=100,recent=0.25").policy.recent == 25
    assert make("h2o:budget=100,recent=30").policy.recent == 30
    assert make("h2o:budget=100,recent=0").policy.recent == 0  # heavy hitters alone
    assert H2OConfig(budget=10).recent_tokens == 5
    c = H2OCache(budget=64, sinks=4, window=8, recent=16, bits=8)
    assert (c.sinks, c.window, c.policy.recent, c.policy.budget) == (4, 8, 16, 64)
    assert c.tiers[0].key_codec.bits == 8
    # each KV head keeps its own tokens: a split by heads holds its share
    assert H2OCache.split_refusal({}, True, False) == H2OCache.split_refusal({}, False, True) == ""


def test_bad_settings_name_the_parameter():
    for bad in ({"recent": -1}, {"recent": float("nan")}, {"recent": 1.0}, {"recent": None}):
        with pytest.raises((ValueError, TypeError), match="recent"):
            H2OCache(**bad)
    with pytest.raises(ValueError, match="budget"):
        H2OCache(budget=12, sinks=4, window=8)
    with pytest.raises(ValueError, match="every"):
        H2OCache(every=0)
    with pytest.raises((ValueError, TypeError), match="recent"):
        H2OPolicy(budget=8, recent=-2)
    with pytest.raises(ValueError, match="recent"):
        make("h2o:budget=16,recent=16")
