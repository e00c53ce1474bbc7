"""ChunkKV: the conformance suite, the chunk selection against NumPy, and layer-wise reuse."""

import copy

import mlx.core as mx
import numpy as np
import pytest

import velox_testing.eviction as ev
import velox_testing.references as refs
from velox_chunkkv import METHOD, ChunkKVCache, ChunkKVPolicy, select_chunks
from velox_core import VeloxCache, load_cache, make_cache, routed, save_cache
from velox_core.policy import WindowVotePolicy
from velox_testing import kv_data, rel_error, tiny_model
from velox_testing.eviction import kept_positions as kept

D = 64
SCALE = D**-0.5
COUNT = "must be a whole number >= 1"
BAD_COUNTS = (0, -3, 2.5, float("nan"), float("inf"), float("-inf"), True, "ten")


class TestChunkKV(ev.FullBudgetConformance):
    """A budget above every length the suite stores: nothing is evicted."""

    bad_settings = (
        *(({"chunk_length": v}, f"chunk_length {COUNT}") for v in BAD_COUNTS),
        *(({"reuse": v}, f"reuse {COUNT}") for v in BAD_COUNTS),
        ({"budget": 41}, "budget=41 must be at least .* 32 \\+ 10 = 42"),  # no room for a chunk
        ({"budget": 200, "chunk_length": 169}, "chunk_length"),
        *ev.VOTE_BAD,
    )

    def make(self):
        return ChunkKVCache(budget=4096)


class TestChunkKVEvicting(ev.Routed, ev.EvictingConformance):
    """A small budget, decode cuts and 4-bit codes: evicting, lossy, bounded."""

    def make(self):
        return ChunkKVCache(budget=64, observe=8, every=8, bits=4, chunk_length=8)

    def make_precise(self):
        return ChunkKVCache(budget=64, observe=8, every=8, chunk_length=8)


class TestChunkKVReuseEvicting(ev.Routed, ev.EvictingConformance):
    """The same with layer-wise index reuse: the suite's model-level caches are linked in
    pairs by make_cache (save/load, copies, batches and generation with followers)."""

    def make(self):
        return ChunkKVCache(budget=64, observe=8, every=8, bits=4, reuse=2)

    def make_precise(self):
        return ChunkKVCache(budget=64, observe=8, every=8, reuse=2)


# -- an independent NumPy transcription ------------------------------------------------------
def numpy_chunks(scores, positions, always, c, k):
    """The kept indices of one row, by the rule written out: the candidates grouped by chunk
    (position // c), each group scored by its mean, groups taken best first while their
    tokens fit in ``k`` less the always-kept tokens, plus the always-kept tokens."""
    groups: dict[int, list[int]] = {}
    for i, (p, a) in enumerate(zip(positions, always)):
        if not a:
            groups.setdefault(int(p) // c, []).append(i)
    ranked = sorted(groups.values(), key=lambda g: -float(np.mean(scores[g])))
    room = k - int(np.sum(always))
    kept = [i for i, a in enumerate(always) if a]
    for g in ranked:
        if len(g) > room:
            break
        kept += g
        room -= len(g)
    return sorted(kept)


def random_row(rng, t, offset, observe, gaps):
    """Strictly increasing positions below ``offset`` ending with the window's, random
    scores, and the always-kept flags (the newest ``observe`` positions)."""
    early = np.sort(rng.choice(offset - observe, size=t - observe, replace=False))
    if not gaps:
        early = np.arange(offset - t, offset - observe)
    pos = np.concatenate([early, np.arange(offset - observe, offset)])
    return rng.random(t).astype(np.float32), pos.astype(np.int32), pos >= offset - observe


def assert_whole_chunks(kept_pos, body_pos, always, c):
    """Every chunk the body holds is kept whole or not at all (always-kept tokens aside)."""
    kept_pos, cand = set(kept_pos), body_pos[~always]
    for chunk in {int(p) // c for p in kept_pos if p in set(cand)}:
        members = {int(p) for p in cand if int(p) // c == chunk}
        assert members <= kept_pos, (chunk, members - kept_pos)


@pytest.mark.parametrize("c", [1, 3, 10, 20])
@pytest.mark.parametrize("gaps", [False, True])
def test_select_chunks_matches_numpy(c, gaps):
    rng = np.random.default_rng(c + 100 * gaps)
    for trial in range(40):
        observe = int(rng.integers(1, 12))
        t = int(rng.integers(observe + c + 2, 300))
        offset = t + (int(rng.integers(0, 500)) if gaps else int(rng.integers(0, 30)))
        k = int(rng.integers(observe + c, t + 5))
        s, pos, always = random_row(rng, t, offset, observe, gaps)
        got = select_chunks(mx.array(s)[None], mx.array(pos)[None], mx.array(always)[None], c, k)
        ref = numpy_chunks(s, pos, always, c, k)
        assert np.array(got[0]).tolist() == ref, (trial, t, k)
        assert len(ref) <= k and set(np.flatnonzero(always)) <= set(ref)
        assert_whole_chunks(pos[ref], pos, always, c)


def test_whole_chunks_keep_the_papers_count():
    """Every chunk whole: ``floor((k - observe) / c)`` chunks besides the window (the
    paper's ``floor((L_max - w) / c)``), the rest of the budget unused."""
    rng = np.random.default_rng(1)
    s, pos, always = random_row(rng, 200, 200, 20, gaps=False)
    for k in (30, 95, 119, 120, 199):
        got = select_chunks(mx.array(s)[None], mx.array(pos)[None], mx.array(always)[None], 10, k)
        assert got.shape[1] == 20 + (k - 20) // 10 * 10


def test_the_last_partial_chunk_is_a_chunk_of_its_own_scored_by_its_mean():
    """Tokens 0..24 with chunks of 10: chunks [0, 10), [10, 20) and the partial [20, 25),
    which kvpress scores by its mean (the paper's sum would rank it last) and keeps whole."""
    s = np.full(25, 0.1, dtype=np.float32)
    s[20:25] = 0.3  # the partial chunk: best mean, smallest sum
    s[0:10] = 0.2
    pos = np.arange(25, dtype=np.int32)
    always = np.zeros(25, dtype=bool)
    args = mx.array(s)[None], mx.array(pos)[None], mx.array(always)[None], 10
    assert np.array(select_chunks(*args, 14)[0]).tolist() == list(range(20, 25))  # 5 + 10 > 14
    assert np.array(select_chunks(*args, 15)[0]).tolist() == [*range(10), *range(20, 25)]


def test_batch_rows_choose_apart_and_keep_one_count():
    """Rows choose their own chunks; a row whose whole chunks come to fewer tokens than
    another's is topped up with the leading tokens of its next-ranked chunk."""
    rng = np.random.default_rng(7)
    c, k, observe = 10, 40, 4
    rows = [random_row(rng, 120, 400, observe, gaps=True) for _ in range(3)]
    s, pos, always = (np.stack(x) for x in zip(*rows))
    got = np.array(select_chunks(mx.array(s), mx.array(pos), mx.array(always), c, k))
    refs = [numpy_chunks(*row, c, k) for row in rows]
    n = max(len(r) for r in refs)
    assert got.shape == (3, n) and n <= k
    for g, r, row in zip(got, refs, rows):
        assert set(r) <= set(g.tolist())
        extra = sorted(set(g.tolist()) - set(r))
        if extra:  # leading tokens of one chunk, the next in the ranking
            chunks = {int(row[1][i]) // c for i in extra}
            assert len(chunks) == 1 and extra == list(range(extra[0], extra[0] + len(extra)))
    same = [i for i, r in enumerate(refs) if len(r) == n]
    assert same and all(got[i].tolist() == refs[i] for i in same)


# -- one layer: the votes, chunked ------------------------------------------------------------
@pytest.mark.parametrize("c", [5, 10, 16])
def test_a_cut_keeps_the_numpy_chunks_in_every_head(c):
    """The whole prompt in one chunk, then the cut: the window's votes summed over the KV
    heads, chunk means, the best chunks that fit in ``budget - observe``: every head keeps
    those and the window."""
    t, h, r, window, budget = 300, 2, 2, 16, 96
    k, v = kv_data(h=h, t=t + 1, d=D, seed=c, dtype=mx.float32)
    q = mx.random.normal((1, h * r, t, D), key=mx.random.key(c)) + k[:, :1, -2:-1] / 4
    cache = ChunkKVCache(budget=budget, observe=window, chunk_length=c)
    ev.feed_attending(cache, k[:, :, :t], v[:, :, :t], q, chunk=t)
    cache.update_and_fetch(k[:, :, t:], v[:, :, t:])
    votes = refs.window_votes_reference(k, q, t, window, SCALE).sum(0)
    pos = np.arange(t)
    always = pos >= t - window
    ref = numpy_chunks(votes.astype(np.float32), pos, always, c, budget)
    for i in range(h):
        assert sorted(kept(cache, i, below=t)) == ref
    assert cache.size() == len(ref) + 1 <= budget + 1
    assert_whole_chunks(ref, pos, always, c)
    assert cache.policy.selected == 1 and cache.policy.reused == 0


def test_one_token_chunks_with_one_kv_head_are_snapkv():
    """chunk_length=1 and a single KV head: the mean of one token is its vote, so ChunkKV
    keeps SnapKV's tokens (same observation window and pooling)."""
    k, v = kv_data(h=1, t=301, d=D, seed=4, dtype=mx.float32)
    q = mx.random.normal((1, 2, 300, D), key=mx.random.key(4))
    a = ChunkKVCache(budget=80, observe=16, chunk_length=1, kernel=7)
    b = VeloxCache(policy=WindowVotePolicy(budget=80, observe=16, kernel=7))  # SnapKV's votes
    with routed():
        for c in (a, b):
            ev.feed_attending(c, k[:, :, :300], v[:, :, :300], q, chunk=150)
            c.update_and_fetch(k[:, :, 300:], v[:, :, 300:])
    assert kept(a) == kept(b) and a.size() == b.size() == 81


def test_the_cut_needs_routed_attention():
    ev.assert_cut_needs_routing(lambda: ChunkKVCache(budget=64, observe=8), t=300, d=D)


def test_decode_cuts_stay_within_budget_plus_every():
    k, v = kv_data(t=260, d=D, dtype=mx.float32)
    q = mx.random.normal((1, 4, 260, D), key=mx.random.key(1))
    c = ChunkKVCache(budget=48, observe=8, every=4, chunk_length=8)
    ev.feed_attending(c, k, v, q, chunk=200, stop=200)
    assert max(ev.decode_attending(c, k, v, q, 200, 260)) <= 48 + 4
    assert c.size() > 48 - 8  # within a chunk of the budget


# -- in a model ------------------------------------------------------------------------------
def prefill(model, caches, prompt, chunk):
    with routed(model):
        for s in range(0, prompt.shape[1], chunk):
            model(prompt[:, s : s + chunk], cache=caches)
            mx.eval([c.state for c in caches])
        return model(prompt[:, -1:], cache=caches)


def test_chunked_prefill_keeps_whole_chunks_and_the_budgets_bytes():
    """Prefill in 64-token chunks (chunks of 16 tokens align with them): every layer holds at
    most budget plus a prefill chunk at any time, keeps whole chunks and the window, and
    after the prompt at most budget + 1 tokens: the bytes of those, nothing more."""
    model = tiny_model("llama", num_hidden_layers=4)
    prompt = mx.random.randint(0, 512, (1, 320), key=mx.random.key(0))
    budget, chunk, observe, c = 96, 64, 16, 16
    caches = make_cache(model, ChunkKVCache(budget=budget, observe=observe, chunk_length=c))
    with routed(model):
        for _ in ev.prefill_checked(model, caches, prompt, chunk):
            assert all(x.size() <= budget + chunk for x in caches)
        model(prompt[:, -1:], cache=caches)
    body = np.arange(320)
    always = body >= 320 - observe
    for x in caches:
        assert x.offset == 321 and x.size() <= budget + 1
        assert x.policy.selected == 4 and x.policy.reused == 0 and x.policy.nbytes == 0
        assert kept(x, 0) == kept(x, 1)  # every KV head keeps the same chunks
        got = sorted(kept(x, 0, below=320))
        assert set(range(320 - observe, 320)) <= set(got)
        assert_whole_chunks(got, body, always, c)
    # bytes: fp16 keys and values of 2 KV heads plus an int32 position, per kept token
    per_token = 2 * (2 * D * 2 + 4)
    sizes = [x.size() for x in caches]
    assert sum(x.logical_nbytes for x in caches) == sum(sizes) * per_token
    assert sum(sizes) <= 4 * (budget + 1)


def test_layer_wise_index_reuse_follows_the_first_layer_of_each_run():
    """reuse=2 on four layers: layers 1 and 3 keep exactly the positions layers 0 and 2 keep,
    without voting; layers 0 and 2 choose their own (here they differ)."""
    model = tiny_model("llama", num_hidden_layers=4)
    prompt = mx.random.randint(0, 512, (1, 300), key=mx.random.key(5))
    caches = make_cache(model, "chunkkv:budget=80,observe=16,reuse=2")
    assert [c.leader for c in caches] == [None, caches[0], None, caches[2]]
    assert [c.policy.followers for c in caches] == [1, 0, 1, 0]
    prefill(model, caches, prompt, chunk=128)
    sets = [kept(c) for c in caches]
    assert sets[1] == sets[0] and sets[3] == sets[2] and sets[0] != sets[2]
    assert [c.policy.selected for c in caches] == [3, 0, 3, 0]
    assert [c.policy.reused for c in caches] == [0, 3, 0, 3]
    assert all(c.policy._record is None for c in caches)  # every follower used it
    # without reuse each layer chooses: the followers' own choice differs from their leader's
    alone = make_cache(model, "chunkkv:budget=80,observe=16")
    assert all(c.leader is None for c in alone)
    prefill(model, alone, prompt, chunk=128)
    assert kept(alone[0]) == sets[0]  # the same first layer (later ones see other inputs)
    assert kept(alone[1]) != kept(alone[0])  # layer 1's own choice is not layer 0's
    assert all(c.policy.reused == 0 for c in alone)


def test_runs_of_reuse_and_layers_with_other_settings():
    """Runs of ``reuse`` among the ChunkKV layers; a layer whose settings differ from the
    run's first starts a run, a layer of another method is skipped."""
    model = tiny_model("llama", num_hidden_layers=6)
    caches = make_cache(model, "chunkkv:budget=80,observe=16,reuse=3")
    assert [c.leader for c in caches] == [None, caches[0], caches[0], None, caches[3], caches[3]]
    caches = make_cache(
        model,
        "chunkkv:budget=80,observe=16,reuse=2",
        layers={1: "chunkkv:budget=96,observe=16,reuse=2", 3: "uniform:bits=8"},
    )
    leaders = [getattr(c, "leader", "other") for c in caches]
    # layer 1's budget differs: it leads a run of its own, and so does layer 2 (not layer
    # 1's settings), whose run goes on at layer 4 (layer 3 is another method's); layer 5
    # leads again
    assert leaders == [None, None, None, "other", caches[2], None]
    prompt = mx.random.randint(0, 512, (1, 200), key=mx.random.key(2))
    prefill(model, caches, prompt, chunk=100)
    assert kept(caches[4]) == kept(caches[2]) and caches[4].policy.reused == 2
    assert [caches[i].policy.reused for i in (0, 1, 2, 5)] == [0, 0, 0, 0]


def test_a_follower_fed_apart_from_its_leader_chooses_its_own():
    """A follower's cut at an offset where its leader recorded none (fed on its own) falls
    back to its own choice: whole chunks within the budget, never the leader's stale ones."""
    k, v = kv_data(t=301, d=D, seed=9, dtype=mx.float32)
    q = mx.random.normal((1, 4, 300, D), key=mx.random.key(9))
    lead, follower = (ChunkKVCache(budget=64, observe=8, reuse=2) for _ in range(2))
    ChunkKVCache.link_layers([lead, follower])
    assert follower.leader is lead
    with routed():
        ev.feed_attending(follower, k[:, :, :300], v[:, :, :300], q, chunk=300)
        follower.update_and_fetch(k[:, :, 300:], v[:, :, 300:])
    assert follower.policy.selected == 1 and follower.policy.reused == 0
    assert follower.size() <= 65


def test_reuse_survives_save_load_and_deepcopy(tmp_path):
    """The cut pending mid-prompt: the file (and a deepcopy) link the layers again, and the
    copies continue as the originals do: the same kept positions, the same logits."""
    model = tiny_model("llama", num_hidden_layers=4)
    prompt = mx.random.randint(0, 512, (1, 260), key=mx.random.key(3))
    caches = make_cache(model, ChunkKVCache(budget=64, observe=8, every=8, reuse=2))
    with routed(model):
        model(prompt[:, :250], cache=caches)
    save_cache(tmp_path / "c.safetensors", caches)
    copies = [load_cache(tmp_path / "c.safetensors"), copy.deepcopy(caches)]
    for other in copies:
        assert [c.config() for c in other] == [c.config() for c in caches]
        assert [c.leader for c in other] == [None, other[0], None, other[2]]
    with routed(model):
        a = model(prompt[:, 250:], cache=caches)
        for other in copies:
            b = model(prompt[:, 250:], cache=other)
            assert rel_error(a, b) < 1e-3
            assert [kept(c) for c in other] == [kept(c) for c in caches]
            assert [c.policy.reused for c in other] == [0, 1, 0, 1]
    assert caches[1].fresh().leader is None  # a fresh layer alone chooses its own


def test_bad_values_are_refused_at_make_cache_naming_the_parameter():
    model = tiny_model("llama", num_hidden_layers=2)
    for name in ("chunk_length", "reuse"):
        for bad in ("nan", "inf", "-inf", "0", "-2", "2.5"):
            with pytest.raises(ValueError, match=f"{name} must be a whole number >= 1"):
                make_cache(model, f"chunkkv:budget=96,{name}={bad}")
        for bad in (float("nan"), float("inf"), 0):
            with pytest.raises(ValueError, match=f"{name} must be a whole number >= 1"):
                make_cache(model, ChunkKVCache(budget=96, **{name: bad}))
    with pytest.raises(ValueError, match=r"budget=48 must be at least .*chunk_length = 32 \+ 20"):
        make_cache(model, "chunkkv:budget=48,chunk_length=20")
    with pytest.raises(ValueError, match="budget"):
        make_cache(model, "chunkkv:budget=nan")
    with pytest.raises(ValueError, match="observe"):
        make_cache(model, "chunkkv:observe=inf")


def test_bad_policy_settings():
    with pytest.raises(ValueError, match="chunk_length"):
        ChunkKVPolicy(budget=64, chunk_length=0)
    with pytest.raises(ValueError, match="chunk_length"):  # no room for a chunk beside window
        VeloxCache(sinks=4, policy=ChunkKVPolicy(budget=40, observe=32, chunk_length=10))
    assert ChunkKVPolicy(budget=64, chunk_length=3).chunk_length == 3


def test_split_by_heads_is_refused():
    assert ChunkKVCache.split_refusal({}, by_heads=False, pipelined=False) == ""
    assert "same chunks in every head" in ChunkKVCache.split_refusal({}, True, False)


def test_recommended_settings_and_registry():
    assert METHOD.name == "chunkkv" and METHOD.paper == "https://arxiv.org/abs/2502.00299"
    fp16, _ = ev.recommended_presets(METHOD, voted=True)
    assert fp16.cfg.reuse == 1 and fp16.cfg.chunk_length == 10
    assert fp16.policy.config() == {
        "budget": 1024,
        "every": None,
        "chunk_length": 10,
        "observe": 32,
        "kernel": 15,
        "pooling": "max",
    }
