"""RocketKV: the conformance suite, the budget split, the page summaries, the hybrid sparse
selection against a NumPy transcription of the authors' algorithm, and the sparse decode."""

import math

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import velox_testing.eviction as ev
from velox_core import load_cache, make_cache, routed, save_cache
from velox_rocketkv import (
    METHOD,
    HybridSparse,
    RocketKVCache,
    RocketKVPolicy,
    body_capacity,
    channels_for,
    page_for,
    paper_split,
    select_tokens,
    stage2_for,
    summarize,
    topk_for,
)
from velox_testing import feed, kv_data, rel_error, tiny_model
from velox_testing.refusals import int_refusals

D = 128


class TestRocketKV(ev.FullBudgetConformance):
    """A budget and a top-k above every length the suite stores: nothing evicted, every
    token attended."""

    bad_settings = (
        ({"ratio": 0.5}, "ratio must be >= 1"),
        ({"ratio": float("nan")}, "ratio"),
        ({"ratio": "6"}, "ratio must be a number"),
        *int_refusals(topk=(1, None), page=(1, None)),
        ({"channels": 0}, "channels must be >= 1"),
        ({"channels": 1.5}, "fraction of the head dim must be at most 1"),
        ({"channels": 0.0}, "channels must be > 0"),
        ({"channels": "half"}, "channels must be a whole number"),
        ({"ratio": None, "topk": 8}, "topk set the second stage, which ratio=None turns off"),
        ({"ratio": None, "page": 2, "channels": 4}, "page, channels set the second stage"),
        ({"budget": 40}, "budget=40 leaves 30 body tokens .* exceed the 32"),
        ({"budget": 36, "window": 30, "sinks": 4}, "budget=36 leaves 1 body tokens"),
        ({"observe": 0}, "observe"),
        ({"kernel": 8}, "kernel must be odd"),
        ({"pooling": "mean"}, "pooling"),
        {"token_budget": 256},  # the paper's name: velox's budget is what a layer keeps
        {"prompt_budget": 256},
    )

    def make(self):
        return RocketKVCache(budget=4096, topk=4096)


class TestRocketKVEvicting(ev.Routed, ev.EvictingConformance):
    """A small budget, decode cuts and 4-bit codes, the second stage active (36 of 72 kept
    tokens attended per step): evicting, sparse, lossy, bounded."""

    def make(self):
        return RocketKVCache(budget=96, observe=8, every=8, bits=4, topk=36)

    def make_precise(self):
        return RocketKVCache(budget=96, observe=8, every=8, topk=36)

    def test_attend_matches_decoded(self):
        """A decode step equals SDPA over the cache's own decoded tokens that the NumPy
        transcription of the selection picks (and not over all of them); several queries
        attend every token."""
        k, v = kv_data(t=300, d=self.head_dim)
        c = feed(self.make(), k, v)
        kk, vv = c.keys_and_values()
        scale = 1 / math.sqrt(self.head_dim)
        q = mx.random.normal((1, 4, 1, self.head_dim), key=mx.random.key(1)).astype(mx.float16)
        got = c.attend(q, scale=scale)
        pol = c.policy
        assert pol.sparse_steps == 1
        page = pol.pages.page
        kt = summarize(kk.astype(mx.float32), page, mx.float16)
        idx = numpy_select(
            np.array(q[:, :, 0], np.float32).reshape(1, 2, 2, -1),
            kt,
            kk.shape[2],
            page,
            pol.sparse.channel_count(self.head_dim),
            36,
            scale,
        )
        ref = sdpa_rows(q, kk, vv, idx, scale)
        assert rel_error(got, ref) < 1e-2
        assert rel_error(got, _sdpa(q, kk, vv, scale)) > 1e-2
        q3 = mx.random.normal((1, 4, 3, self.head_dim), key=mx.random.key(3)).astype(mx.float16)
        got3 = c.attend(q3, scale=scale, mask="causal")
        ref3 = _sdpa(
            q3.astype(mx.float32), kk.astype(mx.float32), vv.astype(mx.float32), scale, "causal"
        )
        assert rel_error(got3, ref3) < 1e-2 and pol.sparse_steps == 1


def _sdpa(q, k, v, scale, mask=None):
    return mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask)


def sdpa_rows(q, kk, vv, idx, scale):
    """SDPA of each KV head's query group over that head's tokens ``idx[b, h]``."""
    hq = q.shape[1]
    h = kk.shape[1]
    r = hq // h
    outs = []
    for j in range(h):
        sel = mx.array(idx[0, j])
        outs.append(
            _sdpa(
                q[:, j * r : (j + 1) * r].astype(mx.float32),
                kk[:, j : j + 1, sel].astype(mx.float32),
                vv[:, j : j + 1, sel].astype(mx.float32),
                scale,
            )
        )
    return mx.concatenate(outs, axis=1)


# -- an independent NumPy transcription of the authors' selection -----------------------------
def numpy_select(q, kt, tokens, page, channels, k, scale):
    """The kept-token indices of each KV head (sets), written out as the authors' code does
    it: channels by the group's summed |q|, the sign of the group's summed q choosing max or
    min, page scores repeated over their tokens, SparQ's temperature, one softmax per query
    head over the tokens, summed over the group, the top k.

    Shapes: q float ``(B, H, R, D)``, kt ``(B, H, P, 2D)``; returns a list of sets per (B, H)."""
    q = np.asarray(q, np.float64)
    kt = np.array(kt.astype(mx.float32), np.float64)
    b, h, _, d = q.shape
    out = np.empty((b, h), dtype=object)
    for bi in range(b):
        for hi in range(h):
            g = q[bi, hi]  # (R, D)
            ch = np.argsort(-np.abs(g).sum(0), kind="stable")[:channels]
            qh = g[:, ch]
            signs = qh.sum(0) > 0
            kh = np.where(signs, kt[bi, hi][:, d + ch], kt[bi, hi][:, ch])  # (P, c)
            s = qh @ kh.T  # (R, P)
            s = np.repeat(s, page, axis=1)[:, :tokens]
            temp = np.sqrt(np.abs(qh).sum(1, keepdims=True) / np.abs(g).sum(1, keepdims=True))
            z = s * scale / temp
            p = np.exp(z - z.max(1, keepdims=True))
            p /= p.sum(1, keepdims=True)
            w = p.sum(0)
            out[bi, hi] = np.argsort(-w, kind="stable")[:k]
    return out


def test_selection_matches_the_authors_algorithm():
    """Whole pages of random keys (k a multiple of the page, so the top tokens are whole
    pages, no ties across pages): the same tokens as the NumPy transcription, at several
    page sizes, channel counts and group sizes."""
    rng = np.random.default_rng(0)
    for page, channels, r, t, k in ((3, 64, 2, 200, 30), (1, 128, 4, 90, 17), (4, 20, 1, 257, 40)):
        keys = mx.array(rng.normal(size=(2, 2, t, D)).astype(np.float32)).astype(mx.float16)
        q = rng.normal(size=(2, 2, r, D)).astype(np.float32)
        kt = summarize(keys, page, mx.float16)
        got = np.array(select_tokens(mx.array(q), kt, t, page, channels, k, 0.09))
        ref = numpy_select(q, kt, t, page, channels, k, 0.09)
        for bi in range(2):
            for hi in range(2):
                assert set(got[bi, hi].tolist()) == set(ref[bi, hi].tolist()), (page, channels)


def test_page_scores_bound_each_tokens_score_and_one_token_pages_are_exact_topk():
    """The paper's invariant: with one query head per KV head and every channel, a page's
    approximate score bounds every score in the page; with one-token pages and every channel
    the selection is the exact top-k of the attention weights summed over the group."""
    rng = np.random.default_rng(1)
    keys = rng.normal(size=(1, 1, 60, D)).astype(np.float32)
    q = rng.normal(size=(1, 1, 1, D)).astype(np.float32)
    kt = np.array(summarize(mx.array(keys), 4, mx.float32))
    pos = q[0, 0, 0] > 0
    bound = np.where(pos, kt[0, 0, :, D:], kt[0, 0, :, :D]) @ q[0, 0, 0]
    true = keys[0, 0] @ q[0, 0, 0]
    assert np.all(np.repeat(bound, 4)[:60] >= true - 1e-4)
    keys = rng.normal(size=(1, 2, 80, D)).astype(np.float32)
    q = rng.normal(size=(1, 2, 3, D)).astype(np.float32)
    got = np.array(
        select_tokens(mx.array(q), summarize(mx.array(keys), 1, mx.float32), 80, 1, D, 12, 0.1)
    )
    for hi in range(2):
        z = 0.1 * q[0, hi] @ keys[0, hi].T
        p = np.exp(z - z.max(1, keepdims=True))
        w = (p / p.sum(1, keepdims=True)).sum(0)
        assert set(got[0, hi].tolist()) == set(np.argsort(-w)[:12].tolist())


# -- the split -------------------------------------------------------------------------------
def test_the_papers_split():
    one, two = paper_split(64)  # the paper's example: 64x into 10.3x and 6.2x
    assert round(one, 1) == 10.3 and round(two, 1) == 6.2 and math.isclose(one * two, 64)
    assert paper_split(1) == (1.0, 1.0)
    assert [round(stage2_for(s), 2) for s in (4, 8, 16, 32)] == [5.07, 6.06, 6.35, 6.12]
    assert [page_for(x) for x in (1, 2, 3.63, 6, 10, 16, 17)] == [1, 2, 2, 3, 4, 4, 5]
    assert channels_for(6, 3, 128) == 64 and channels_for(1, 1, 128) == 128
    assert channels_for(40, 7, 64) == 11 and channels_for(1000, 32, 64) == 2
    assert topk_for(768, 6) == 64 and topk_for(5, 6) == 1


@settings(max_examples=300, deadline=None)
@given(st.integers(0, 3000), st.integers(1, 40), st.sampled_from([1.0, 0.5, 1.6, 3.2, 7.0]))
def test_body_capacity_is_the_most_tokens_whose_summaries_fit(room, page, weight):
    n = body_capacity(room, page, weight)
    assert n + weight * -(-n // page) <= room + 1e-9
    assert n + 1 + weight * -(-(n + 1) // page) > room
    assert body_capacity(room, None, weight) == room
    if weight == 1.0:
        assert n == room - -(-room // (page + 1))


def test_defaults_follow_the_split():
    c = RocketKVCache()
    pol = c.policy
    got = (pol.sparse.page_size, pol.sparse.channel_count(128), pol.body_budget(c.policy_view))
    assert got == (3, 64, 768)
    assert pol.sparse.top_k(768) == 64
    assert METHOD.recommended[0] == {"budget": 1024}
    assert HybridSparse(2.0, channels=0.25).channel_count(128) == 32


# -- the page summaries ------------------------------------------------------------------------
def test_summaries_are_each_pages_min_and_max():
    keys = mx.array(np.random.default_rng(2).normal(size=(2, 2, 11, 8)).astype(np.float32))
    kt = np.array(summarize(keys, 4, mx.float32))
    k = np.array(keys)
    assert kt.shape == (2, 2, 3, 16)
    for p, (a, e) in enumerate(((0, 4), (4, 8), (8, 11))):
        assert np.array_equal(kt[:, :, p, :8], k[:, :, a:e].min(2))
        assert np.array_equal(kt[:, :, p, 8:], k[:, :, a:e].max(2))


def _decode_steps(c, k, v, q, prompt: int):
    """``c`` stores the first ``prompt`` tokens of ``k, v`` at once, then the rest a token at
    a time, each step attended by the one query ``q`` (scale 0.1); yields each step's token
    once attended."""
    c.update_and_fetch(k[:, :, :prompt], v[:, :, :prompt])
    for i in range(prompt, k.shape[2]):
        c.update_and_fetch(k[:, :, i : i + 1], v[:, :, i : i + 1])
        c.attend(q, scale=0.1)
        yield i


@pytest.mark.parametrize("bits", [None, 4])
def test_summaries_kept_by_appends_equal_summaries_made_again(bits):
    """Decode steps extend the summaries in place (the last page rewritten or a new one
    opened); they equal the body's keys (as decoded) summarized from scratch at every step."""
    k, v = kv_data(t=140, d=D)
    c = RocketKVCache(budget=4096, topk=8, bits=bits)
    q = mx.random.normal((1, 4, 1, D), key=mx.random.key(0)).astype(mx.float16)
    with routed():
        for i in _decode_steps(c, k, v, q, 100):
            body = mx.concatenate(c.policy_view.body_keys(), axis=1)  # decoded by the key codec
            want = summarize(body.astype(mx.float32), 3, mx.float16)
            assert mx.array_equal(c.policy.pages.store.view().data["kt"], want).item(), i
    assert c.policy.sparse_steps == 40


def test_cuts_and_trims_make_the_summaries_again():
    k, v = kv_data(t=400, d=D)
    c = RocketKVCache(budget=120, observe=8, every=4, topk=10)
    q = mx.random.normal((1, 4, 1, D), key=mx.random.key(0)).astype(mx.float16)
    with routed():
        for i in _decode_steps(c, k, v, q, 300):
            if i in (350, 380):
                c.trim(3)
                c.update_and_fetch(k[:, :, :3], v[:, :, :3])
                c.attend(q, scale=0.1)
            kk, _ = c.keys_and_values()
            want = summarize(kk.astype(mx.float32), 3, mx.float16)
            assert mx.array_equal(c.policy.pages.store.view().data["kt"], want).item(), i
    assert c.size() <= 3 + body_capacity(120, 3) + 4


# -- the sparse decode -------------------------------------------------------------------------
def test_a_decode_step_attends_topk_tokens_per_kv_head_and_every_token_below_it():
    k, v = kv_data(t=500, d=D)
    q = mx.random.normal((1, 4, 1, D), key=mx.random.key(5)).astype(mx.float16)
    with routed():
        c = feed(RocketKVCache(budget=256, topk=32, sinks=4, window=8), k, v)
        kk, vv = c.keys_and_values()
        got = c.attend(q, scale=0.1)
    pol = c.policy
    assert pol.sparse_steps == 1
    body = kk[:, :, 4 : 4 + c.body_sizes()[0]]
    kt = summarize(body.astype(mx.float32), 3, mx.float16)
    picked = numpy_select(
        np.array(q[:, :, 0], np.float32).reshape(1, 2, 2, -1), kt, body.shape[2], 3, 64, 32, 0.1
    )
    idx = np.empty((1, 2), dtype=object)
    for hi in range(2):  # the sinks, the picked body tokens, the window
        sel = sorted(int(i) + 4 for i in picked[0, hi])
        idx[0, hi] = [0, 1, 2, 3, *sel, *range(kk.shape[2] - 8, kk.shape[2])]
        assert len(idx[0, hi]) == 4 + 32 + 8
    assert rel_error(got, sdpa_rows(q, kk, vv, idx, 0.1)) < 1e-3
    assert rel_error(got, _sdpa(q, kk, vv, 0.1)) > 1e-2
    with routed():
        small = feed(RocketKVCache(budget=256, topk=2000), k, v)  # never more than topk
        kk, vv = small.keys_and_values()
        assert rel_error(small.attend(q, scale=0.1), _sdpa(q, kk, vv, 0.1)) < 1e-3
    assert small.policy.sparse_steps == 0


def test_without_the_second_stage_rocketkv_is_snapkv_with_its_pooling():
    """ratio=None: no summaries, every kept token attended, and the kept tokens are velox
    SnapKV's with kernel 63 (SnapKV++'s GQA votes are velox-core's)."""
    SnapKVCache = pytest.importorskip(
        "velox_snapkv", reason="compares with velox-snapkv (its nox session installs it)"
    ).SnapKVCache
    model = tiny_model("llama", head_dim=D, hidden_size=256)
    prompt = mx.random.randint(0, 512, (1, 600), key=mx.random.key(3))
    kept = []
    for spec in (
        RocketKVCache(budget=128, ratio=None, every=None),
        SnapKVCache(budget=128, kernel=63),
    ):
        caches = make_cache(model, spec)
        with routed(model):
            for s in range(0, 600, 128):
                model(prompt[:, s : s + 128], cache=caches)
            logits = model(mx.array([[7]]), cache=caches)
        kept.append(([c.policy_view.body_positions()[0] for c in caches], logits))
    for a, b in zip(kept[0][0], kept[1][0]):
        assert mx.array_equal(a, b).item()
    assert mx.allclose(kept[0][1], kept[1][1], atol=1e-4).item()
    c = make_cache(model, RocketKVCache(budget=128, ratio=None))[0]
    assert c.policy.pages is None and c.policy.state() == {}


def test_bytes_stay_within_the_budget_and_decode_stays_bounded():
    """A cut keeps the body and its summaries within the budget's bytes (fp16 keys and values
    of equal width: a summary is a token's size); with every=8, 200 decode steps hold at most
    the kept tokens plus 8, and every step attends sparsely."""
    model = tiny_model("llama", head_dim=D, hidden_size=256)
    prompt = mx.random.randint(0, 512, (1, 700), key=mx.random.key(4))
    caches = make_cache(model, RocketKVCache(budget=200, every=8))
    with routed(model):
        model(prompt[:, :512], cache=caches)
        model(prompt[:, 512:], cache=caches)
        y = mx.array([[1]])
        sizes = []
        for _ in range(200):
            y = mx.argmax(model(y, cache=caches)[:, -1:], axis=-1)
            sizes.append(caches[0].size())
    kept = body_capacity(200, 3)
    assert max(sizes) == kept + 8 and min(sizes) == kept + 1  # cut, then the step stored
    c = caches[0]
    h = c.kv_heads
    token = 2 * D * 2 * h  # fp16 key and value, every KV head
    pages = -(-c.body_sizes()[0] // 3)
    assert c.policy.pages.store.view().data["kt"].shape[2] == pages
    # the kept tokens and their summaries: at most the budget's bytes, plus those of the
    # every tokens that wait for the next cut and of their pages
    assert (body_capacity(200, 3) + -(-body_capacity(200, 3) // 3)) * token <= 200 * token
    assert (c.size() + pages) * token <= (200 + 8 + 3) * token
    assert c.policy.sparse_steps == 200


def test_state_and_files_carry_the_summaries(tmp_path):
    k, v = kv_data(t=300, d=D)
    q = mx.random.normal((1, 4, 1, D), key=mx.random.key(6)).astype(mx.float16)
    with routed():
        c = feed(RocketKVCache(budget=120, observe=8, topk=12), k, v)
        a = c.attend(q, scale=0.1)
        st_ = c.policy.state()
        assert "pages.kt" in st_ and c.policy.nbytes >= st_["pages.kt"].nbytes > 0
        path = tmp_path / "r.safetensors"
        save_cache(path, [c])
        (loaded,) = load_cache(path)
        assert loaded.policy.pages.covered == c.policy.pages.covered
        assert mx.array_equal(loaded.policy.pages.store.view().data["kt"], st_["pages.kt"]).item()
        assert rel_error(loaded.attend(q, scale=0.1), a) < 1e-3
        feed([c, loaded], k[:, :, :20], v[:, :, :20], chunks=1)
        assert rel_error(loaded.attend(q, scale=0.1), c.attend(q, scale=0.1)) < 1e-3
    bad = RocketKVPolicy(budget=120, observe=8)
    with pytest.raises(ValueError, match="page summaries must be"):
        bad.set_state({"pages.kt": mx.zeros((1, 2, 5, 2 * D))}, {"pages": {"covered": 99}})
    with pytest.raises(ValueError, match="without stage 2"):
        RocketKVPolicy(budget=120, observe=8, ratio=None).set_state(
            {"pages.kt": mx.zeros((1, 2, 5, 2 * D))}, {}
        )


def test_coded_tokens_leave_room_for_summaries_at_their_bytes():
    """With 4-bit codes a summary (fp16) weighs 3.2 coded tokens: a cut keeps 495 of
    budget=1024, and tokens plus summaries hold no more bytes than 1024 coded tokens; a
    budget that leaves no voted token at those weights is refused at make_cache."""
    model = tiny_model("llama", head_dim=D, hidden_size=256)
    prompt = mx.random.randint(0, 512, (1, 1600), key=mx.random.key(8))
    caches = make_cache(
        model, RocketKVCache(budget=1024, bits=4, group=32), storage_dtype=mx.float16
    )
    with routed(model):
        model(prompt[:, :1024], cache=caches)
        model(prompt[:, 1024:], cache=caches)
        model(mx.array([[3]]), cache=caches)  # the cut the last chunk owes, then one step
    c = caches[0]
    pol = c.policy
    assert pol.summary_weight(c.policy_view) == pytest.approx(3.2)
    assert c.body_sizes()[0] == body_capacity(1024, 3, 3.2) + 1 == 496
    per_token = (c.logical_nbytes - pol.nbytes) / c.size()  # codes and position, every head
    page_bytes = pol.pages.state()["kt"].nbytes / -(-496 // 3)
    assert page_bytes == pytest.approx(3.2 * (per_token - 4 * c.kv_heads))  # positions aside
    assert 495 * per_token + -(-495 // 3) * page_bytes <= 1024 * per_token
    with pytest.raises(ValueError, match="a summary the bytes of 3.20 kept tokens"):
        make_cache(model, RocketKVCache(budget=64, bits=4, group=32))
    assert make_cache(model, RocketKVCache(budget=64))[0].method == "rocketkv"


def test_channels_above_the_head_dim_are_refused_at_make_cache():
    model = tiny_model("llama", head_dim=64, hidden_size=256)
    with pytest.raises(ValueError, match="channels=100 exceeds the key head dim 64"):
        make_cache(model, "rocketkv:budget=256,channels=100")
    assert make_cache(model, "rocketkv:budget=256,channels=64")[0].method == "rocketkv"


def test_prefill_prompt_cuts_once_at_the_prompts_end_as_one_chunk_does():
    """prefill="prompt": the prompt's chunks are held whole and cut at the first decode step,
    keeping what the prompt prefilled in one chunk keeps (its last queries vote once)."""
    model = tiny_model("llama", head_dim=D, hidden_size=256)
    prompt = mx.random.randint(0, 512, (1, 700), key=mx.random.key(9))

    def run(chunk, prefill):
        caches = make_cache(model, RocketKVCache(budget=160, prefill=prefill))
        with routed(model):
            for s in range(0, 700, chunk):
                model(prompt[:, s : s + chunk], cache=caches)
            held = [c.size() for c in caches]
            mx.eval(model(mx.array([[5]]), cache=caches))
        return held, [
            [np.array(p).tolist() for p in c.policy_view.body_positions()] for c in caches
        ]

    held, chunked = run(128, "prompt")
    assert held == [700] * len(held)  # nothing cut during the prompt
    _, once = run(700, "prompt")
    assert chunked == once
    _, per_chunk = run(128, "chunks")
    assert per_chunk != once  # cuts after each chunk keep other tokens
    assert all(len(row) == body_capacity(160, 3) + 1 for ly in once for hd in ly for row in hd)
