"""Expected Attention: the conformance suite, and what is Expected Attention's own."""

import functools
import math

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import KVCache

import velox_testing.eviction as ev
from velox_core import (
    Uniform,
    VeloxCache,
    load_cache,
    make_cache,
    parse_spec,
    routed,
    save_cache,
)
from velox_expected_attention import (
    METHOD,
    ExpectedAttentionCache,
    ExpectedAttentionPolicy,
    QueryStats,
    average_rotation,
    expected_attention_scores,
    model_rope,
)
from velox_testing import kv_data, rel_error, tiny_model
from velox_testing.refusals import named_refusals

D = 64
BASE = 10000.0


class TestExpectedAttention(ev.FullBudgetConformance):
    bad_settings = (
        ({"n_sink": 4}, "n_sink"),  # kvpress's name: velox's shared `sinks` (default 4)
        *named_refusals(n_future_positions=0, epsilon=[-1e-3, float("nan"), float("inf")]),
        *named_refusals(use_vnorm=1, use_covariance="yes"),
    )

    def make(self):
        return ExpectedAttentionCache(budget=4096)


class TestExpectedAttentionEvicting(ev.Routed, ev.EvictingConformance):
    """A small budget, decode cuts and 4-bit codes. The suite fills caches with
    update_and_fetch alone (and attends by hand), so every test runs routed, and the caches
    made by hand are given the RoPE of the suite's model (``rope_base``)."""

    def make(self):
        return ExpectedAttentionCache(budget=64, every=8, bits=4, rope_base=BASE)

    def make_precise(self):
        return ExpectedAttentionCache(budget=64, every=8, rope_base=BASE)


# -- an independent NumPy transcription of kvpress 0.5.5's ExpectedAttentionPress -------------
def np_rope(x, positions, base=BASE, dims=None, traditional=False):
    """RoPE of ``x`` ``(..., T, D)`` at ``positions`` ``(T,)``, float64 (mlx.nn.RoPE's)."""
    d = x.shape[-1]
    dims = d if dims is None else dims
    theta = base ** (-np.arange(0, dims, 2, dtype=np.float64) / dims)
    ang = np.asarray(positions, dtype=np.float64)[:, None] * theta
    cos, sin = np.cos(ang), np.sin(ang)
    out = np.array(x, dtype=np.float64)
    if traditional:
        x1, x2 = out[..., 0:dims:2].copy(), out[..., 1:dims:2].copy()
        out[..., 0:dims:2], out[..., 1:dims:2] = x1 * cos - x2 * sin, x1 * sin + x2 * cos
    else:
        h = dims // 2
        x1, x2 = out[..., :h].copy(), out[..., h:dims].copy()
        out[..., :h], out[..., h:dims] = x1 * cos - x2 * sin, x1 * sin + x2 * cos
    return out


def np_avg_rope_matrix(d, start, n, base=BASE):
    """kvpress's ``apply_avg_rope`` matrix: ``mean_p (diag(cos_p) + diag(sin_p) P)`` with
    HF's ``cos``/``sin`` (each frequency twice) and ``P`` the rotate-half matrix."""
    theta = base ** (-np.arange(0, d, 2, dtype=np.float64) / d)
    freqs = np.arange(start, start + n, dtype=np.float64)[:, None] * theta
    emb = np.concatenate([freqs, freqs], axis=-1)  # (n, d)
    cos, sin = np.cos(emb), np.sin(emb)
    p = np.zeros((d, d))
    p[d // 2 :, : d // 2], p[: d // 2, d // 2 :] = np.eye(d // 2), -np.eye(d // 2)
    r = cos[:, None, :] * np.eye(d) + sin[:, None, :] * p
    return r.mean(axis=0)


def kvpress_scores(q_pre, keys, values, n_sink=4, n_future=512, cov=True, vnorm=True, eps=0.0):
    """``ExpectedAttentionPress.score`` for one sequence, in float64.

    Args:
        q_pre: the prompt's pre-RoPE queries ``(Hq, T, D)`` (kvpress: ``q_proj`` of the
            hidden states); keys, values: post-RoPE keys and values ``(H, T, D)``.

    Returns:
        ``(H, T)``: the sinks at ``max + 1``, as kvpress pads them.
    """
    hq, t, d = q_pre.shape
    h = keys.shape[0]
    q = q_pre[:, n_sink:]
    mu = q.mean(axis=1)
    c = q - mu[:, None]
    sigma = np.einsum("hsi,hsj->hij", c, c) / q.shape[1]
    r = np_avg_rope_matrix(d, t, n_future)
    mu = mu @ r.T
    sigma = r @ sigma @ r.T
    k = np.repeat(keys[:, n_sink:], hq // h, axis=0)  # repeat_kv
    s = np.einsum("hd,htd->ht", mu, k) / math.sqrt(d)
    if cov:
        s = s + np.einsum("htd,hde,hte->ht", k, sigma, k) / d / 2
    s = np.exp(s - s.max(axis=-1, keepdims=True))
    s = (s / s.sum(axis=-1, keepdims=True)).reshape(h, hq // h, -1).mean(axis=1)
    if vnorm:
        s = (s + eps) * np.linalg.norm(values[:, n_sink:], axis=-1)
    return np.concatenate([np.full((h, n_sink), s.max() + 1), s], axis=1)


def kvpress_kept(scores, n_kept):
    """Positions of the ``n_kept`` highest scores per head (kvpress's ``topk``)."""
    return [set(np.argsort(-row, kind="stable")[:n_kept].tolist()) for row in scores]


def gaussian_queries(t, h=2, r=2, seed=0, d=D):
    """Pre-RoPE queries with a mean and a few strong directions (a Gaussian far from
    isotropic, as real queries are), post-RoPE keys and values: float64 ``q (h*r, t, d)``,
    ``k, v (h, t, d)``."""
    rng = np.random.default_rng(seed)
    hq = h * r
    mean = rng.normal(0, 1.0, (hq, 1, d))
    mix = rng.normal(0, 1.0, (hq, d, d)) * np.exp(rng.normal(0, 0.8, d))
    q = mean + np.einsum("hte,hed->htd", rng.normal(size=(hq, t, d)), mix) / math.sqrt(d)
    k_pre = rng.normal(0, 1, (h, t, d)) * np.exp(rng.normal(0, 0.5, d)) + rng.normal(0, 0.5, d)
    v = rng.normal(0, 1, (h, t, d)) * rng.uniform(0.3, 2.0, (h, t, 1))
    return q, np_rope(k_pre, np.arange(t)), v


def prefill(cache, q_post, k, v, chunk):
    """As a routed model: store each chunk, then attend with its (post-RoPE) queries."""
    t = k.shape[2]
    for s in range(0, t, chunk):
        e = min(s + chunk, t)
        cache.update_and_fetch(k[:, :, s:e], v[:, :, s:e])
        cache.attend(q_post[:, :, s:e], D**-0.5, mask="causal")


def next_token(cache, seed=9):
    """One decode token: its update runs the cut that follows a prefill chunk."""
    h, d, dv = cache.kv_heads, cache.key_dim, cache.stored.dims[3]
    k = mx.random.normal((1, h, 1, d), key=mx.random.key(seed))
    v = mx.random.normal((1, h, 1, dv), key=mx.random.key(seed + 1))
    cache.update_and_fetch(k, v)


def kept(cache, head, below=None):
    """Absolute positions of ``head``'s sinks and body tokens (below ``below`` if given)."""
    pos = set(range(cache.policy_view.sink_count())) | set(
        np.array(cache.policy_view.body_positions()[head][0]).tolist()
    )
    return {p for p in pos if below is None or p < below}


def as_mx(*arrays):
    return tuple(mx.array(np.asarray(a, dtype=np.float32)[None]) for a in arrays)


# -- the mathematics -----------------------------------------------------------------------
def test_average_rotation_is_kvpress_matrix_and_identity_without_rope():
    from velox_core.ops.rope import RopeSpec

    spec = RopeSpec.from_base(BASE, D)
    got = np.array(average_rotation(spec, D, 300, 512))
    assert np.allclose(got, np_avg_rope_matrix(D, 300, 512), atol=2e-6)
    assert np.array_equal(np.array(average_rotation(None, D, 300, 512)), np.eye(D))
    # a partial RoPE leaves the channels past its dims as they are
    part = np.array(average_rotation(RopeSpec.from_base(BASE, 32), D, 10, 7))
    assert np.allclose(part[32:, 32:], np.eye(32)) and np.allclose(part[:32, 32:], 0)


def test_running_moments_over_chunks_equal_the_moments_of_all_queries():
    rng = np.random.default_rng(1)
    q = rng.normal(3.0, 2.0, (2, 4, 300, 16)).astype(np.float32)
    stats = QueryStats(covariance=True)
    for s, e in ((0, 7), (7, 8), (8, 200), (200, 300)):
        stats.add(mx.array(q[:, :, s:e]))
    mean, cov = (np.array(a) for a in stats.moments())
    q64 = q.astype(np.float64)
    ref_mean = q64.mean(axis=2)
    c = q64 - ref_mean[:, :, None]
    ref_cov = np.einsum("bhti,bhtj->bhij", c, c) / 300  # population, as kvpress divides
    assert np.array(stats.count).tolist() == [300, 300]
    assert np.allclose(mean, ref_mean, atol=1e-5) and np.allclose(cov, ref_cov, atol=2e-4)


def test_scores_are_kvpress_formula():
    rng = np.random.default_rng(2)
    hq, h, t = 4, 2, 50
    mean = rng.normal(size=(1, hq, D))
    a = rng.normal(size=(1, hq, D, D)) / 8
    cov = a @ np.swapaxes(a, -1, -2)
    k, v = rng.normal(size=(1, h, t, D)), rng.normal(size=(1, h, t, D))
    got = expected_attention_scores(*(mx.array(x.astype(np.float32)) for x in (mean, cov, k, v)))
    kk = np.repeat(k[0], 2, axis=0)
    s = np.einsum("hd,htd->ht", mean[0], kk) / 8  # sqrt(d)
    s = s + np.einsum("htd,hde,hte->ht", kk, cov[0], kk) / 128  # 2d
    p = np.exp(s - s.max(-1, keepdims=True))
    ref = (p / p.sum(-1, keepdims=True)).reshape(h, 2, t).mean(1) * np.linalg.norm(v[0], axis=-1)
    assert np.allclose(np.array(got[0]), ref, rtol=1e-4, atol=1e-7)


@pytest.mark.parametrize(
    ("r", "settings"),
    [
        (2, {}),
        (1, {}),
        (3, {}),
        (2, {"use_covariance": False}),
        (2, {"use_vnorm": False}),
        (2, {"epsilon": 0.01}),
        (2, {"n_future_positions": 1}),
        (2, {"sinks": 0}),
    ],
)
def test_a_prompt_in_one_chunk_keeps_what_kvpress_keeps(r, settings):
    """One prefill chunk, then a token: the kept positions are those kvpress's
    ``ExpectedAttentionPress`` keeps at the same count (a float64 NumPy transcription fed the
    pre-RoPE queries; velox sees them post-RoPE and turns them back)."""
    t, n_kept = 400, 100
    q_pre, k, v = gaussian_queries(t, r=r, seed=3 + r)
    ref = kvpress_scores(
        q_pre,
        k,
        v,
        n_sink=settings.get("sinks", 4),
        n_future=settings.get("n_future_positions", 512),
        cov=settings.get("use_covariance", True),
        vnorm=settings.get("use_vnorm", True),
        eps=settings.get("epsilon", 0.0),
    )
    c = ExpectedAttentionCache(budget=n_kept, rope_base=BASE, **settings)
    qq, kk, vv = as_mx(np_rope(q_pre, np.arange(t)), k, v)
    ns = settings.get("sinks", 4)
    with routed():
        prefill(c, qq, kk, vv, chunk=t)
        # the scores velox ranks the body by are kvpress's (past the sinks' padding)
        for head, s in enumerate(c.policy.score(c.policy_view)):
            assert np.allclose(np.array(s[0]), ref[head, ns:], rtol=2e-3, atol=1e-9), head
        next_token(c)
    assert c.size() == n_kept + 1
    for head, want in enumerate(kvpress_kept(ref, n_kept)):
        assert kept(c, head, below=t) == want, head


@pytest.mark.parametrize("traditional", [False, True])
def test_the_rope_layout_and_partial_rope_are_undone_exactly(traditional):
    """Queries rotated with a traditional or partial RoPE, turned back by the policy: the
    moments it holds are the pre-RoPE queries' (beyond the sinks)."""
    t = 120
    q_pre, k, v = gaussian_queries(t, seed=11)
    dims = 32 if traditional else D
    q_post = np_rope(q_pre, np.arange(t), dims=dims, traditional=traditional)
    c = ExpectedAttentionCache(
        budget=200, rope_base=BASE, rope_traditional=traditional, rope_dims=dims
    )
    qq, kk, vv = as_mx(q_post, k, v)
    with routed():
        prefill(c, qq, kk, vv, chunk=50)
    mean, cov = (np.array(a)[0] for a in c.policy.stats.moments())
    q = q_pre[:, 4:]
    assert np.allclose(mean, q.mean(axis=1), atol=1e-4)
    cc = q - q.mean(axis=1, keepdims=True)
    assert np.allclose(cov, np.einsum("hti,htj->hij", cc, cc) / (t - 4), atol=1e-3)


def test_chunked_prefill_scores_each_cut_with_every_query_so_far():
    """Each chunk's cut ranks the earlier survivors plus the chunk by kvpress's score with
    the moments of the whole prompt so far and the RoPE averaged past the chunk's end."""
    t, budget, chunk = 300, 64, 100
    q_pre, k, v = gaussian_queries(t, seed=12)
    c = ExpectedAttentionCache(budget=budget, rope_base=BASE)
    qq, kk, vv = as_mx(np_rope(q_pre, np.arange(t)), k, v)
    survivors = [set(range(t)) for _ in range(2)]
    with routed():
        for s in range(0, t, chunk):
            c.update_and_fetch(kk[:, :, s : s + chunk], vv[:, :, s : s + chunk])
            if s:  # the cut that followed the previous chunk
                for head in range(2):
                    assert kept(c, head, below=s) == survivors[head], (s, head)
            c.attend(qq[:, :, s : s + chunk], D**-0.5, mask="causal")
            end = s + chunk
            ref = kvpress_scores(q_pre[:, :end], k[:, :end], v[:, :end])
            for head in range(2):
                body = sorted(p for p in (kept(c, head) | set(range(s, end))) if p >= 4)
                order = sorted(body, key=lambda p: -ref[head, p])
                survivors[head] = set(range(4)) | set(order[: budget - 4])
        next_token(c)
    for head in range(2):
        assert kept(c, head, below=t) == survivors[head]


def test_layer_zero_of_a_tiny_model_keeps_what_kvpress_keeps():
    """Inside a routed model, the RoPE read from the model: at layer 0 (whose keys and
    queries do not depend on the cache) the kept tokens are kvpress's choice from the
    queries it computes itself (``q_proj`` of the normed hidden states, pre-RoPE)."""
    model = tiny_model("llama", dtype=mx.float32)
    prompt = mx.random.randint(0, 512, (1, 300), key=mx.random.key(0))
    full = [KVCache() for _ in model.layers]
    model(prompt, cache=full)
    k0, v0 = (np.array(a[0, :, :300]).astype(np.float64) for a in (full[0].keys, full[0].values))
    attn = model.layers[0].self_attn
    x = model.model.layers[0].input_layernorm(model.model.embed_tokens(prompt))
    q = attn.q_proj(x).reshape(1, 300, attn.n_heads, -1).transpose(0, 2, 1, 3)
    ref = kvpress_scores(np.array(q[0]).astype(np.float64), k0, v0)
    caches = make_cache(model, ExpectedAttentionCache(budget=96))
    with routed(model):
        model(prompt, cache=caches)
        model(mx.array([[5]]), cache=caches)
    known, spec = caches[0].policy.rope_for(D)
    assert known and spec.same_as(model_rope(model, 0))
    for head, want in enumerate(kvpress_kept(ref, 96)):
        assert kept(caches[0], head, below=300) == want, head
    assert all(c.size() == 97 for c in caches)


# -- the behaviour -----------------------------------------------------------------------------
def test_bytes_stay_within_the_budget_through_prefill_and_decode():
    """Prefill in chunks, then decode with ``every``: at most ``budget`` plus a chunk (or
    plus ``every``) tokens per KV head, and the bytes are exactly those tokens' (fp16 keys and
    values, an int32 position per body token) plus the query moments and the RoPE."""
    model = tiny_model("llama")
    prompt = mx.random.randint(0, 512, (1, 600), key=mx.random.key(1))
    budget, chunk, every = 96, 128, 8
    caches = make_cache(model, ExpectedAttentionCache(budget=budget, every=every))
    h, d, hq = 2, D, 4
    with routed(model):
        for s in range(0, 600, chunk):
            model(prompt[:, s : s + chunk], cache=caches)
            assert all(c.size() <= budget + chunk for c in caches)
        for i in range(40):
            model(mx.array([[i + 3]]), cache=caches)
            assert all(c.size() <= budget + every for c in caches)
    mx.eval([c.state for c in caches])
    stats = 4 * (hq * d + hq * d * d) + 4 + (4 * d // 2 + 8)  # moments, count, rope arrays
    for c in caches:
        assert c.offset == 640 and c.policy.nbytes == stats
        tokens = h * (4 * 4 * d + (c.size() - 4) * (4 * d + 4))  # 4 sinks without position
        assert c.logical_nbytes == tokens + stats
        assert c.logical_nbytes <= h * (budget + every) * (4 * d + 4) + stats


def test_without_every_decode_holds_no_statistics():
    model = tiny_model("llama")
    prompt = mx.random.randint(0, 512, (1, 300), key=mx.random.key(2))
    caches = make_cache(model, ExpectedAttentionCache(budget=64))
    with routed(model):
        model(prompt, cache=caches)
        assert all(not c.policy.stats.empty for c in caches)
        model(mx.array([[1]]), cache=caches)  # the prompt's cut, then the moments are dropped
    assert all(c.policy.stats.empty and c.size() == 65 for c in caches)
    assert all(set(c.policy.state()) == {"rope_theta", "rope_layout"} for c in caches)


def test_saved_cache_keeps_its_statistics_and_cuts_the_same(tmp_path):
    model = tiny_model("llama")
    prompt = mx.random.randint(0, 512, (1, 250), key=mx.random.key(3))
    caches = make_cache(model, ExpectedAttentionCache(budget=48, every=8, bits=4, group=32))
    with routed(model):
        model(prompt[:, :200], cache=caches)  # the cut pending
    save_cache(tmp_path / "c.safetensors", caches)
    loaded = load_cache(tmp_path / "c.safetensors")
    for a, b in zip(caches, loaded):
        assert isinstance(b.policy, ExpectedAttentionPolicy)
        assert b.policy.config() == a.policy.config()
        assert b.policy.rope_for(D)[1].same_as(a.policy.rope_for(D)[1])  # no model needed
        assert np.array_equal(np.array(b.policy.stats.m2), np.array(a.policy.stats.m2))
    with routed(model):
        x = model(prompt[:, 200:], cache=caches)
        y = model(prompt[:, 200:], cache=loaded)
        x2 = model(mx.array([[3]]), cache=caches)
        y2 = model(mx.array([[3]]), cache=loaded)
    assert rel_error(y, x) < 1e-3 and rel_error(y2, x2) < 1e-3
    for a, b in zip(caches, loaded):
        assert a.size() == b.size() and kept(a, 0) == kept(b, 0) and kept(a, 1) == kept(b, 1)


def test_batch_rows_use_their_own_queries():
    t = 200
    rows = [gaussian_queries(t, seed=s) for s in (20, 21)]
    q_post = np.stack([np_rope(q, np.arange(t)) for q, _, _ in rows])
    k, v = np.stack([x[1] for x in rows]), np.stack([x[2] for x in rows])
    both = ExpectedAttentionCache(budget=40, rope_base=BASE)
    qq, kk, vv = (mx.array(a.astype(np.float32)) for a in (q_post, k, v))
    with routed():
        prefill(both, qq, kk, vv, chunk=t)
        both.update_and_fetch(kk[:, :, :1], vv[:, :, :1])
    pos = np.array(mx.stack(both.policy_view.body_positions(), axis=1))
    for row, (q_pre, kr, vr) in enumerate(rows):
        want = kvpress_kept(kvpress_scores(q_pre, kr, vr), 40)
        for head in range(2):
            assert set(pos[row, head].tolist()) - {t} | set(range(4)) == want[head]
    one = both.extract(1)
    assert np.array_equal(np.array(one.policy.stats.mean[0]), np.array(both.policy.stats.mean[1]))


def test_without_queries_the_cut_is_refused_unless_routed():
    make = functools.partial(ExpectedAttentionCache, budget=40, rope_base=BASE)
    c, _, _ = ev.assert_cut_needs_routing(make, t=200, d=D)
    # routed, where no query reached the cache: the most recent
    assert kept(c, 0) == set(range(4)) | set(range(163, 200))


def test_a_cache_made_by_hand_needs_the_rope_to_use_its_queries():
    """Queries without a known RoPE cannot be turned back: the cut names make_cache and
    rope_base rather than score with rotated queries."""
    k, v = kv_data(t=200, d=D)
    q = mx.random.normal((1, 4, 199, D), key=mx.random.key(4))
    c = ExpectedAttentionCache(budget=40)
    with routed():
        prefill(c, q, k[:, :, :199], v[:, :, :199], chunk=199)
        with pytest.raises(ValueError, match=r"make_cache\(model.*rope_base"):
            c.update_and_fetch(k[:, :, 199:], v[:, :, 199:])


def test_rope_base_must_agree_with_the_models():
    model = tiny_model("mistral")  # rope_theta 1e6
    with pytest.raises(ValueError, match="rope_base"):
        make_cache(model, ExpectedAttentionCache(budget=64, rope_base=BASE))
    caches = make_cache(model, ExpectedAttentionCache(budget=64, rope_base=1e6))
    assert caches[0].policy.rope_for(D)[1].same_as(model_rope(model, 0))


def test_layers_without_rope_use_the_queries_as_they_are():
    class Attn:
        use_rope = False

    class Layer:
        self_attn = Attn()

    class Model:
        layers = (Layer(),)

    assert model_rope(Model(), 0) is None
    from mlx_lm.models.smollm3 import NoPE

    Attn.use_rope, Attn.rope = True, NoPE()
    assert model_rope(Model(), 0) is None
    p = ExpectedAttentionPolicy(budget=64)
    p.bind(Model(), 0)
    assert p.rope_for(D) == (True, None)


def test_composes_with_codes_sinks_and_a_window():
    """8-bit codes of the kept tokens, sinks and a window kept as given: the body between
    them is cut to ``budget - sinks - window``."""
    t = 300
    q_pre, k, v = gaussian_queries(t, seed=30)
    qq, kk, vv = as_mx(np_rope(q_pre, np.arange(t)), k, v)
    c = VeloxCache(
        Uniform(8, group=32),
        Uniform(8, group=32),
        sinks=4,
        window=16,
        policy=ExpectedAttentionPolicy(budget=60, rope_base=BASE),
    )
    with routed():
        prefill(c, qq, kk, vv, chunk=t)
        next_token(c)
    # the cut kept 40 body tokens; then 284 left the window as token 300 arrived
    assert c.size() == 61 and c.body_sizes() == [41, 41]
    got, _ = c.keys_and_values()
    assert mx.array_equal(got[:, :, :4], kk[:, :, :4])  # the sinks, as given
    assert mx.array_equal(got[:, :, -16:-1], kk[:, :, 285:300])  # the window, as given
    for head in range(2):
        body = kept(c, head) - set(range(4))
        assert len(body & set(range(4, 284))) == 40 and 284 in body


def test_recommended_settings_and_defaults():
    fp16, _ = ev.recommended_presets(METHOD)
    cfg = fp16.policy.config()
    # kvpress 0.5.5's ExpectedAttentionPress defaults
    assert (cfg["n_future_positions"], cfg["use_covariance"], cfg["use_vnorm"]) == (512, True, True)
    assert cfg["epsilon"] == 0.0 and fp16.sinks == 4 and fp16.window == 0 and cfg["every"] is None
    assert METHOD.paper == "https://arxiv.org/abs/2510.00636"
    assert ExpectedAttentionCache.split_refusal(fp16.config(), True, True) == ""


@pytest.mark.parametrize(
    ("spec", "match"),
    [
        ("epsilon=nan", "epsilon must be a finite number"),
        ("epsilon=inf", "epsilon must be a finite number"),
        ("epsilon=-0.5", "epsilon must be >= 0"),
        ("n_future_positions=0", "n_future_positions must be >= 1"),
        ("n_future_positions=-3", "n_future_positions must be >= 1"),
        ("budget=4", "budget=4 must exceed sinks"),
        ("sinks=-1", "sinks"),
        ("every=0", "every must be >= 1"),
        ("rope_base=0.5", "rope_base must be > 1"),
        ("rope_base=nan", "rope_base must be a finite number"),
        ("rope_scale=inf,rope_base=10000", "rope_scale must be a finite number"),
        ("n_sink=4", "n_sink"),
        ("compression_ratio=0.5", "compression_ratio"),
    ],
)
def test_bad_values_are_refused_at_make_cache_naming_the_parameter(spec, match):
    model = tiny_model("llama")
    with pytest.raises(ValueError, match=match):
        make_cache(model, f"expected-attention:{spec}")


@pytest.mark.parametrize(
    ("spec", "match"),
    [
        ("use_vnorm=2", "use_vnorm must be True or False"),
        ("use_covariance=yes", "use_covariance must be True or False"),
        ("n_future_positions=1.5", "n_future_positions must be an int"),
    ],
)
def test_values_of_the_wrong_type_are_refused_naming_the_parameter(spec, match):
    with pytest.raises((TypeError, ValueError), match=match):
        make_cache(tiny_model("llama"), f"expected-attention:{spec}")
    with pytest.raises((TypeError, ValueError), match=match):
        ExpectedAttentionPolicy(**parse_spec(f"expected-attention:{spec}")[1])
