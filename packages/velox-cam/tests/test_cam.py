"""CaM: the conformance suite, and what is CaM's own."""

import mlx.core as mx
import numpy as np
import pytest

import velox_testing.eviction as ev
import velox_testing.references as refs
from velox_cam import METHOD, CamCache, CamConfig, CamPolicy
from velox_core import Uniform, VeloxCache, make, make_cache, routed
from velox_testing import rel_error, tiny_model
from velox_testing.eviction import SCALE, D
from velox_testing.refusals import share_refusals


class TestCam(ev.FullBudgetConformance):
    # fp16 tokens (512 B a token and KV head at head dim 128), the body's int32 positions and
    # the float32 accumulated score: 520 B
    max_memory_ratio = 1.02
    bad_settings = (
        ({"merge": 0}, "merge"),
        ({"merge": 2.0}, "merge"),
        ({"merge": True}, "merge"),
        ({"budget": 64, "merge": 33}, "merge"),  # 32 sinks, 32 newest: more than they hold
        ({"budget": 64, "sinks": 8, "window": 48, "merge": 16}, "merge"),
        *share_refusals("sinks"),
        ({"budget": 64, "sinks": 0.99}, "budget|merge"),
        ({"seed": -1}, "seed"),
        ({"seed": 0.5}, "seed"),
        {"start_ratio": 0.1},  # the authors' flags: velox counts tokens (budget, sinks)
        {"recent_ratio": 0.1},
        {"start_size": 4},
        {"merge_num": 16},
        {"recent": 512},
    )

    def make(self):
        return CamCache(budget=4096)


class TestCamEvicting(ev.Routed, ev.EvictingConformance):
    """A small budget (32 sinks and the 32 newest tokens), a merge and an eviction at every
    decode step, and 4-bit codes. The suite fills caches with update_and_fetch alone, so every
    test runs routed (a cut of tokens no query has seen is refused otherwise); tokens no query
    has attended score zero and are dropped unmerged."""

    def make(self):
        return CamCache(budget=64, bits=4)

    def make_precise(self):
        return CamCache(budget=64)


# -- helpers ---------------------------------------------------------------------------------
class Draws:
    """The uniform numbers of the merge draws: from ``seed``'s first split key (layer 0),
    split at every cut that evicts, one number per evicted token and KV head."""

    def __init__(self, seed=0):
        self.key = mx.random.split(mx.random.key(seed), 1)[0]

    def next(self, h, n):
        keys = mx.random.split(self.key)
        self.key = keys[0]
        return np.array(mx.random.uniform(shape=(1, h, n), key=keys[1]))[0]


class PaperCam(refs.ScoreReference):
    """The authors' cache (``generate_task/streaming_llm/kv_cache_cam.py``,
    ``StartRecentKVCache_cam``) transcribed in numpy, float64, per KV head: the kept
    positions, their values and their accumulated attention. A call stores its tokens (score
    0), attends causally with its queries and adds each query's softmax weights (GQA: the
    mean over the KV head's query heads); then, while over ``budget``, it evicts the oldest
    token after the ``start`` first ones: merged, with the next uniform number below
    ``A_e / mean(A of the merge tokens after it)`` (0/0: not merged), by adding
    ``v_e / merge`` to those tokens' values.

    ``every``: velox's cadence (a cut once ``every`` tokens over, or after a prompt chunk;
    the authors' is 1). ``drop``: a control that evicts without merging (StreamingLLM)."""

    def __init__(self, k, v, q, budget, start, merge, every=1, drop=False, scale=SCALE):
        super().__init__(k, q)
        self.v0 = np.array(v[0], np.float64)
        self.budget, self.start, self.merge, self.drop = budget, start, merge, drop
        self.every, self.scale = every, scale
        self.draws = Draws()
        self.val = [np.zeros((0, self.k.shape[2])) for _ in range(self.h)]
        self.merged = 0  # evictions that merged

    def attend(self, s, e):
        self.store(s, e)
        for h in range(self.h):
            self.val[h] = np.concatenate([self.val[h], self.v0[h, s:e]])
            for i in range(s, e):
                seen, w = self.weights(h, i, self.scale)
                self.score[h][seen] += w

    def reduce(self, chunk=False):
        n = len(self.pos[0]) - self.budget
        if n <= 0 or (n < self.every and not chunk):
            return
        u = self.draws.next(self.h, n)
        for h in range(self.h):
            for i in range(n):
                e, m = self.start, self.merge
                a, nxt = self.score[h][e], self.score[h][e + 1 : e + 1 + m].mean()
                p = 0.0 if a == 0 and nxt == 0 else min(a / nxt, 1.0) if nxt > 0 else 1.0
                if u[h, i] < p and not self.drop:
                    self.val[h][e + 1 : e + 1 + m] += self.val[h][e] / m
                    self.merged += 1
                keep = np.arange(len(self.pos[h])) != e
                self.pos[h], self.val[h] = self.pos[h][keep], self.val[h][keep]
                self.score[h] = self.score[h][keep]

    def kept(self, h=0):
        return self.pos[h].tolist()


def stored(cache, head=0):
    """Positions and values of every token the cache stores for one KV head (row 0)."""
    _, vv = cache.keys_and_values()
    body = cache.policy_view.body_positions()[head]
    n_sink, t = cache.policy_view.sink_count(), 0 if body is None else body.shape[1]
    n_win = cache.size() - n_sink - t
    pos = list(range(n_sink))
    pos += [] if body is None else np.array(body[0]).tolist()
    pos += list(range(cache.offset - n_win, cache.offset))
    return pos, np.array(vv[0, head].astype(mx.float32))


def run_both(k, v, q, t0, budget, start, merge, chunk, **kw):
    """velox and the transcription side by side over a prompt of ``t0`` tokens (in chunks of
    ``chunk``), then one decode step per remaining token: the same tokens, values and scores
    after every cut. Returns the transcription."""
    t = k.shape[2]
    c = CamCache(budget=budget, sinks=start, merge=merge, **kw)
    ref = PaperCam(k, v, q, budget, start, merge, every=kw.get("every", 1))
    for s, e in [(s, min(s + chunk, t0)) for s in range(0, t0, chunk)] + [
        (i, i + 1) for i in range(t0, t)
    ]:
        c.update_and_fetch(k[:, :, s:e], v[:, :, s:e])  # velox cuts here (the pending cut)
        for h in range(ref.h):
            pos, val = stored(c, h)
            assert pos == ref.kept(h) + list(range(s, e)), (s, h)
            assert np.allclose(val[: len(pos) - (e - s)], ref.val[h], rtol=1e-4, atol=1e-5)
        c.attend(q[:, :, s:e], SCALE, mask="causal" if e - s > 1 else None)
        ref.attend(s, e)
        got = np.array(c.policy._scores[0])
        for h in range(ref.h):
            assert np.allclose(got[h], ref.score[h], rtol=1e-4, atol=1e-6), (s, h)
        ref.reduce(chunk=e - s > 1)
    return ref


# -- the mathematics ---------------------------------------------------------------------------
@pytest.mark.parametrize("r", [1, 3])
def test_decode_merges_as_the_authors_cache(r):
    """The authors' rule step by step: the prompt in one chunk, cut to budget (its evicted
    values merged oldest first), then each decode step adds its query's weights and evicts
    the oldest token after the sinks, merged or not by its draw. MHA (r=1) and GQA (r=3)."""
    k, v, q = ev.attention_data(200, r=r, seed=r)
    ref = run_both(k, v, q, t0=120, budget=48, start=8, merge=16, chunk=120)
    # both outcomes happen: some evicted values merged, some dropped
    evicted = 2 * (200 - 48)
    assert 0 < ref.merged < evicted, ref.merged
    # merging changes the kept values: StreamingLLM's eviction keeps the tokens as given
    drop = PaperCam(k, v, q, 48, 8, 16, drop=True)
    for s, e in [(0, 120)] + [(i, i + 1) for i in range(120, 200)]:
        drop.attend(s, e)
        drop.reduce()
    assert drop.kept(0) == ref.kept(0)
    assert not np.allclose(drop.val[0], ref.val[0])


def test_chunked_prefill_merges_each_cut_token_by_token():
    """A prompt in chunks: each cut evicts a chunk's worth of tokens, the oldest first, each
    merging (with what it received) into the 16 after it, some of which leave in the same
    cut."""
    k, v, q = ev.attention_data(260, seed=7)
    ref = run_both(k, v, q, t0=240, budget=40, start=4, merge=16, chunk=64)
    assert ref.merged > 0


def test_merge_size_and_the_sink_share():
    """merge=1 (each value into the next token alone) and merge filling the whole recent
    part; sinks as a share of the budget (the authors' even split by default)."""
    k, v, q = ev.attention_data(150, seed=4)
    run_both(k, v, q, t0=100, budget=32, start=16, merge=16, chunk=50)
    run_both(k, v, q, t0=100, budget=32, start=4, merge=1, chunk=100, every=4)
    assert CamCache(budget=32).sinks == 16 and CamCache(budget=33, sinks=0.25).sinks == 8


def test_merge_keeps_the_evicted_share_of_the_output_in_expectation():
    """Why CaM merges with probability A_e / mean(A_next): a query that gives the merge
    tokens equal attention receives A_e * v_e from them in expectation. One query scores 40
    tokens (equal attention, but 0.4 of it on position 4, which holds a large value); the
    next update evicts position 4. Over many seeds it is merged in about 40% of the runs, and
    the mean output of the merged caches is near the full cache's; dropping it is not."""
    rng = np.random.default_rng(3)
    t, m = 40, 16
    q = rng.normal(size=D).astype(np.float32)
    k = np.zeros((1, 1, t + 1, D), np.float32)
    k[0, 0, 4] = q * np.log(0.4) / (q @ q)  # q . k4 = log 0.4: a weight 0.4 of the others'
    v = rng.normal(size=(1, 1, t + 1, D)).astype(np.float32)
    v[0, 0, 4] *= 20.0  # the evicted token's share dominates the output
    v[0, 0, t] = 0.0
    k, v, q = mx.array(k), mx.array(v), mx.array(q.reshape(1, 1, 1, D))
    full = mx.fast.scaled_dot_product_attention(q, k, v, scale=1.0)

    def run(seed, vote=True):
        c = CamCache(budget=t - 1, sinks=4, merge=m, seed=seed)
        with routed():
            c.update_and_fetch(k[:, :, :t], v[:, :, :t])
            if vote:
                c.attend(q, 1.0)  # each token's one vote: 0.4 of the others' at position 4
            c.update_and_fetch(k[:, :, t:], v[:, :, t:])  # evicts position 4
        assert 4 not in stored(c)[0]
        return c.attend(q, 1.0)

    outs = [run(seed) for seed in range(400)]
    dropped = run(0, vote=False)  # no votes: zero scores, never merged
    merged_runs = sum(not mx.allclose(o, dropped, atol=1e-6).item() for o in outs)
    assert 120 < merged_runs < 200  # 400 draws of probability 0.4: 160 +- 10
    mean = mx.mean(mx.stack(outs), axis=0)
    assert rel_error(mean, full) < 0.3 * rel_error(dropped, full)


def test_sinks_window_and_codes_compose():
    """Sinks and window are kept as given; values merge into the oldest body tokens; the
    merged values are coded again (8-bit codes here)."""
    k, v, q = ev.attention_data(301, seed=5, sharp=0.1)
    c = VeloxCache(Uniform(8), Uniform(8), sinks=4, window=8, policy=CamPolicy(budget=44, merge=16))
    for s in range(0, 300, 100):
        c.update_and_fetch(k[:, :, s : s + 100], v[:, :, s : s + 100])
        c.attend(q[:, :, s : s + 100], SCALE, mask="causal")
    c.update_and_fetch(k[:, :, 300:], v[:, :, 300:])
    kk, vv = c.keys_and_values()
    assert c.size() == 45 and c.body_sizes() == [33, 33]
    assert mx.array_equal(kk[:, :, :4], k[:, :, :4]) and mx.array_equal(vv[:, :, :4], v[:, :, :4])
    assert mx.array_equal(vv[:, :, -8:], v[:, :, 293:301])
    for h in range(2):
        pos, val = stored(c, h)
        assert pos == [0, 1, 2, 3, *range(260, 301)]
        body = val[4:37]
        moved = np.abs(body - np.array(v[0, h, 260:293])).max(axis=1)
        assert moved[:16].max() > 0.1 and moved[16:].max() < 0.05  # the merge tokens moved
    with pytest.raises(ValueError, match="merge=16 must be at most"):
        VeloxCache(sinks=4, window=8, policy=CamPolicy(budget=27, merge=16))


# -- the behaviour -----------------------------------------------------------------------------
def test_layer_zero_of_a_tiny_model_matches_the_transcription():
    """Routed, chunked prefill then decode in a real mlx-lm model: at layer 0 (its keys,
    values and queries do not depend on the cache) velox keeps the tokens and the merged
    values the transcription keeps, fed the layer's own keys, values and queries; every layer
    stays at budget + 1 in decode."""
    model = tiny_model("llama", dtype=mx.float32)
    prompt = mx.random.randint(0, 512, (1, 256), key=mx.random.key(0))
    steps = [7, 11, 13, 17, 19, 23]
    budget, start, chunk = 64, 8, 128
    caches = make_cache(model, CamCache(budget=budget, sinks=start))
    k0, v0, q0 = ev.observed_layer_zero(model, caches, prompt, steps, chunk, size=budget + 1)
    ref = PaperCam(k0, v0, q0, budget, start, 16, scale=model.layers[0].self_attn.scale)
    for s, e in [(0, 128), (128, 256)] + [(i, i + 1) for i in range(256, 261)]:
        ref.attend(s, e)
        ref.reduce()
    assert ref.merged > 0
    for h in range(k0.shape[1]):
        pos, val = stored(caches[0], h)
        assert pos == [*ref.kept(h), 261], h
        assert np.allclose(val[:-1], ref.val[h], rtol=1e-4, atol=1e-4), h
    assert all(c.offset == 262 for c in caches)


def test_memory_is_freed_and_the_budget_honoured():
    """The evicted tokens leave memory: in decode the cache holds budget + 1 tokens, its
    bytes those of the kept tokens (fp16 keys and values, int32 positions, float32 scores)."""
    k, v, q = ev.attention_data(300, seed=8)
    k, v = k.astype(mx.float16), v.astype(mx.float16)
    c = CamCache(budget=32)
    with routed():
        c.update_and_fetch(k[:, :, :200], v[:, :, :200])
        c.attend(q[:, :, :200].astype(mx.float16), SCALE, mask="causal")
        for i in range(200, 300):
            c.update_and_fetch(k[:, :, i : i + 1], v[:, :, i : i + 1])
            assert c.size() == 33
            c.attend(q[:, :, i : i + 1].astype(mx.float16), SCALE)
    mx.eval(c.state)
    per_token = 2 * (2 * D * 2)  # fp16 keys and values of 2 KV heads
    assert c.logical_nbytes <= 33 * per_token + 17 * 2 * 4 + 33 * 2 * 4 + 64
    assert c.policy._scores.shape == (1, 2, 33) and c.body_sizes() == [17, 17]


def test_a_decode_cut_reads_and_writes_the_merged_rows_alone(monkeypatch):
    """A decode cut decodes the values of the evicted token and the ``merge`` after it, no
    others, and writes the merged values over the ``merge`` oldest kept tokens once the
    evicted one has left: ``merge`` rows in place, not a copy of the body's values."""
    from velox_core.cache.store import PackedStore

    k, v, q = ev.attention_data(2300, seed=3)
    c = CamCache(budget=2048, sinks=4, merge=16)
    c.fetch_decoded = False  # routed attention reads the cache: update_and_fetch decodes none
    ev.feed_attending(c, k, v, q, chunk=550, stop=2200)
    with routed():  # the cut the prompt's last chunk owes, then a decode step
        for i in (2200, 2201):
            c.update_and_fetch(k[:, :, i : i + 1], v[:, :, i : i + 1])
            mx.eval(c.attend(q[:, :, i : i + 1], SCALE))
    codec = c.tiers[0].value_codec
    decoded, writes = [], []
    decode, write = codec.decode, PackedStore.write

    def decoding(rec):
        decoded.append(rec.tokens)
        return decode(rec)

    def writing(store, start, packed):
        mx.eval(store.arrays())  # the cut's gather done (the merged values not yet)
        mx.synchronize()
        base = mx.get_active_memory()
        mx.reset_peak_memory()
        write(store, start, packed)
        mx.eval(store.arrays())
        mx.synchronize()
        writes.append((start, packed.tokens, store.tokens, mx.get_peak_memory() - base))

    monkeypatch.setattr(codec, "decode", decoding)
    monkeypatch.setattr(PackedStore, "write", writing)
    with routed():
        for i in range(2202, 2300):
            decoded.clear()
            c.update_and_fetch(k[:, :, i : i + 1], v[:, :, i : i + 1])
            assert decoded == [1 + 16], i  # the evicted token and the 16 after it
            mx.eval(c.attend(q[:, :, i : i + 1], SCALE))
    body = c.body_sizes()[0] - 1  # the kept body tokens at the write (the new one not yet)
    values = c.stored.coded[0][1].nbytes
    assert {w[:3] for w in writes} == {(0, 16, body)} and len(writes) == 98
    assert max(w[3] for w in writes) < values / 4  # no copy of the values' buffer


def test_without_queries_the_cut_is_refused_unless_routed():
    c, _, v = ev.assert_cut_needs_routing(lambda: CamCache(budget=40), t=300, d=D)
    # routed, where no query reached the cache: zero scores, nothing merged
    _, vv = c.keys_and_values()  # 20 sinks, the 20 newest before the cut, the new token
    assert c.size() == 41 and mx.array_equal(vv[:, :, 20:], v[:, :, 279:300])


def test_saved_state_draws_the_same_after_loading(tmp_path):
    k, v, q = ev.attention_data(330, seed=8)
    c = CamCache(budget=32, bits=4, group=32)
    for s in range(0, 300, 150):
        c.update_and_fetch(k[:, :, s : s + 150], v[:, :, s : s + 150])
        c.attend(q[:, :, s : s + 150], SCALE, mask="causal")  # the second cut pending
    d = ev.reloaded(c, tmp_path / "c.safetensors")
    assert d.policy.meta() == c.policy.meta() == {"chunk_pending": True, "seen": 300, "draws": 1}
    assert set(d.policy.state()) == {"scores", "key"}
    assert d.policy.nbytes == c.policy.nbytes == 4 * 2 * c.size() + 8
    for x in (c, d):
        with routed():
            for i in range(300, 330):
                x.update_and_fetch(k[:, :, i : i + 1], v[:, :, i : i + 1])
                x.attend(q[:, :, i : i + 1], SCALE)
    assert stored(c, 0)[0] == stored(d, 0)[0] and d.size() == 33
    assert mx.array_equal(d.keys_and_values()[1], c.keys_and_values()[1])
    assert mx.array_equal(c.policy._key, d.policy._key)


def test_bad_state_is_refused():
    k, v, q = ev.attention_data(120, seed=3)
    c = CamCache(budget=32)
    c.update_and_fetch(k[:, :, :100], v[:, :, :100])
    c.attend(q[:, :, :100], SCALE, mask="causal")
    p = CamPolicy(budget=32)
    assert p.meta() == {"chunk_pending": False, "seen": 0, "draws": 0} and p.state() == {}
    state = c.policy.state()
    with pytest.raises(ValueError, match=r"key must be uint32 \(2,\)"):
        p.set_state({"scores": state["scores"]}, {})
    with pytest.raises(ValueError, match=r"key must be uint32 \(2,\)"):
        p.set_state({**state, "key": mx.zeros((3,), dtype=mx.uint32)}, {})
    with pytest.raises(ValueError, match=r"float32 \(B, H, S\)"):
        p.set_state({**state, "scores": mx.zeros((2, 100))}, {})


def test_a_batch_row_merges_as_it_does_alone():
    """The draws are shared by the rows, so a row's merges do not depend on the batch."""
    k0, v0, q0 = ev.attention_data(201, seed=10)
    k1, v1, q1 = ev.attention_data(201, seed=11)
    k, v, q = (mx.concatenate(p, axis=0) for p in ((k0, k1), (v0, v1), (q0, q1)))
    both, alone = CamCache(budget=24, sinks=4), CamCache(budget=24, sinks=4)
    for x, kk, vv, qq in ((both, k, v, q), (alone, k1, v1, q1)):
        with routed():
            for s in range(0, 201, 67):
                x.update_and_fetch(kk[:, :, s : s + 67], vv[:, :, s : s + 67])
                x.attend(qq[:, :, s : s + 67], SCALE, mask="causal")
            x.update_and_fetch(kk[:, :, :1], vv[:, :, :1])
    a, b = both.keys_and_values()[1][1:], alone.keys_and_values()[1]
    assert mx.allclose(a, b, atol=1e-5).item()
    one = both.extract(1)
    assert mx.allclose(one.keys_and_values()[1], b, atol=1e-5).item()


def test_trim_drops_the_trimmed_scores():
    k, v, q = ev.attention_data(170, seed=9)
    c = CamCache(budget=400)
    with routed():
        c.update_and_fetch(k[:, :, :160], v[:, :, :160])
        c.attend(q[:, :, :160], SCALE, mask="causal")
        assert not c.is_trimmable()
        c.trim(5)
        c.update_and_fetch(k[:, :, 155:157], v[:, :, 155:157])
    assert c.policy._scores.shape == (1, 2, 157) and c.offset == 157


def test_recommended_settings_defaults_and_split():
    assert METHOD.paper == "https://proceedings.mlr.press/v235/zhang24n.html"
    fp16, _ = ev.recommended_presets(METHOD)
    assert fp16.policy.config() == {"budget": 1024, "every": 1, "merge": 16, "seed": 0}
    assert fp16.sinks == 512 and fp16.window == 0
    assert make("cam:budget=100,sinks=4,merge=32").sinks == 4
    assert make("cam:budget=100,sinks=0.25").sinks == 25
    assert CamConfig(budget=10, merge=5).sink_tokens == 5
    # each KV head keeps the same positions and merges with its own draws: a split by heads
    # holds its share
    assert CamCache.split_refusal({}, True, False) == CamCache.split_refusal({}, False, True) == ""


def test_bad_settings_name_the_parameter():
    for bad in ({"merge": 0}, {"sinks": 1.5}, {"sinks": float("inf")}, {"seed": -2}):
        with pytest.raises((ValueError, TypeError), match=next(iter(bad))):
            CamCache(**bad)
    assert make("cam:budget=40").policy.merge == 16  # 20 sinks, 20 newest: merge=16 fits
    with pytest.raises(ValueError, match="merge=16 must be at most"):
        make("cam:budget=30")  # 15 newest: merge=16 does not
    with pytest.raises(ValueError, match="every"):
        CamCache(every=0)
    with pytest.raises((ValueError, TypeError), match="merge"):
        CamPolicy(budget=8, merge=0)
