"""NestedKV: the conformance suite, and what is NestedKV's own."""

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import QuantizedKVCache

import velox_testing.eviction as ev
from velox_core import Uniform, VeloxCache, load_cache, make, make_cache, routed, save_cache
from velox_nestedkv import METHOD, NestedKVCache, NestedKVPolicy, head_budgets, nested_score
from velox_testing import attention_errors_vs_mlx_quant, fill_chunks, kv_data, rel_error, tiny_model

FP16, FOUR_BIT = METHOD.recommended


class TestNestedKV(ev.FullBudgetConformance):
    bad_settings = (
        {"recent": 0},
        {"block": 0},
        {"beta": -1.0},
        {"kappa": -1.0},
        {"prior": (0.5, 0.5)},
        {"prior": (0.5, 0.5, 0.0)},
        {"safeguard": 1.5},
        {"heads": "mixed"},
        {"tau": "high"},
    )

    def make(self):
        return NestedKVCache(budget=4096)


class TestNestedKVEvicting(ev.EvictingConformance):
    """A small budget with 4-bit codes, re-compressed during decode: lossy, bounded.
    (Per-head budgets store one record per head, which the protocol checks cannot read, so
    this class keeps ``budget`` tokens in every head.)"""

    def make(self):
        return NestedKVCache(budget=64, every=8, bits=4, heads="uniform")


# -- helpers ----------------------------------------------------------------------------------
def feed(cache, k, v, chunks=()):
    """Feed ``k, v``: the given chunks (a prompt), then the rest one token at a time."""
    start = 0
    for n in [*chunks, *[1] * (k.shape[2] - sum(chunks))]:
        cache.update_and_fetch(k[:, :, start : start + n], v[:, :, start : start + n])
        start += n
    return cache


def as_kv(keys):
    """``(H, T, D)`` numpy keys to fp16 ``(1, H, T, D)`` keys and random values."""
    k = mx.array(np.asarray(keys, np.float32)[None]).astype(mx.float16)
    v = mx.random.normal(k.shape, key=mx.random.key(0)).astype(mx.float16)
    return k, v


def reference(keys, block, window):
    """The paper's anomalies computed at once over ``keys`` (T, D): (a_s, a_e, a_c)."""
    u = keys / np.linalg.norm(keys, axis=1, keepdims=True)

    def anomaly(x, mu):
        return -(x @ mu) / np.linalg.norm(mu)

    t = len(u)
    a_s = anomaly(u, u.mean(0))
    a_e = np.array(
        [anomaly(u[i], u[i // block * block : (i // block + 1) * block].mean(0)) for i in range(t)]
    )
    a_c = np.array([anomaly(u[i], u[max(0, i - window + 1) : i + 1].mean(0)) for i in range(t)])
    return a_s, a_e, a_c


def body_anomalies(cache):
    """Per head: body positions and the policy's raw (a_s, a_e, a_c), as numpy."""
    parts = cache.policy.anomalies(cache.policy_view)
    pos = cache.policy_view.body_positions()
    return [(np.array(p[0]), *(np.array(a[0]) for a in parts[h])) for h, p in enumerate(pos)]


def directions(d, *idx):
    e = np.zeros((len(idx), d), np.float32)
    e[np.arange(len(idx)), idx] = 1.0
    return e


# -- the three memories -------------------------------------------------------------------------
@pytest.mark.parametrize("heads", ["uniform", "adaptive"])
def test_streamed_statistics_equal_the_papers_one_shot_formulas(heads):
    """Chunked prefill, evictions and decode steps: the anomalies of every kept token equal
    the paper's formulas over *all* keys seen (evicted ones included)."""
    k, v = kv_data(t=520, h=2, d=64, seed=3)
    c = NestedKVCache(budget=160, sinks=4, window=8, heads=heads, every=16, recent=64)
    with routed(tiny_model()):
        feed(c, k, v, (150, 1, 1, 97, 1, 1, 1, 200, 1))
    b = c.policy.meta()["block"]
    assert b == 128  # the paper's clip(⌊N/32⌋, 128, 256) at the first compression (N = 152)
    keys = np.array(k[0].astype(mx.float32))
    for h, (pos, a_s, a_e, a_c) in enumerate(body_anomalies(c)):
        r_s, r_e, r_c = reference(keys[h, : c.offset], b, 64)
        assert len(pos) < c.offset - 20  # tokens were evicted
        np.testing.assert_allclose(a_s, r_s[pos], atol=1e-4)
        np.testing.assert_allclose(a_e, r_e[pos], atol=2e-3)  # fp16 per-token storage
        np.testing.assert_allclose(a_c, r_c[pos], atol=2e-3)


def test_stable_memory_counts_evicted_keys_and_flags_novel_ones():
    """The stable anchor is the sum of every unit key seen; a key far from it is the most
    anomalous and survives eviction."""
    d, t = 32, 301
    rng = np.random.default_rng(0)
    keys = directions(d, *[0] * t) + 0.05 * rng.normal(size=(t, d))
    novel = [37, 150, 260]
    keys[novel] = directions(d, 1, 1, 1) + 0.05 * rng.normal(size=(3, d))
    k, v = as_kv(np.stack([keys, keys]))
    c = feed(NestedKVCache(budget=40, sinks=0, heads="uniform"), k, v, (100, 100, 100))
    assert c.policy.meta()["seen"] == c.offset - 1 == 300
    u = keys[:300] / np.linalg.norm(keys[:300], axis=1, keepdims=True)
    np.testing.assert_allclose(np.array(c.policy.state()["stable"][0, 0]), u.sum(0), atol=2e-2)
    pos, a_s, *_ = body_anomalies(c)[0]
    assert set(novel) <= set(pos.tolist())  # kept through three compressions
    assert set(pos[np.argsort(a_s)[-3:]].tolist()) == set(novel)


def test_episodic_memory_scores_a_key_against_its_own_block():
    """Blocks of repeated keys: a key foreign to its block is anomalous, the same key inside a
    block of its kind is not."""
    d, b = 16, 32
    x, y = directions(d, 0, 1)
    keys = np.stack([x] * b + [y] * b + [x] * 8)
    keys[10] = y
    k, v = as_kv(keys[None])
    c = feed(NestedKVCache(budget=512, sinks=0, block=b, recent=4), k, v, (60,))
    pos, _, a_e, _ = body_anomalies(c)[0]
    at = dict(zip(pos.tolist(), a_e.tolist()))
    expected = -(y @ (31 * x + y)) / np.linalg.norm(31 * x + y)
    assert at[10] == pytest.approx(expected, abs=2e-3)
    assert at[40] == pytest.approx(-1.0, abs=2e-3)  # y among y: typical of its block
    assert at[10] == max(at.values())


def test_current_memory_looks_back_over_the_recent_window_only():
    d, w = 16, 4
    x, y = directions(d, 0, 1)
    keys = np.stack([x] * 20 + [y] + [x] * 30)
    k, v = as_kv(keys[None])
    c = feed(NestedKVCache(budget=512, sinks=0, recent=w, block=128), k, v, (25,))
    pos, _, _, a_c = body_anomalies(c)[0]
    at = dict(zip(pos.tolist(), a_c.tolist()))
    mean = 3 * x + y  # the window ending at the odd key: three x, then y itself
    assert at[20] == pytest.approx(-(y @ mean) / np.linalg.norm(mean), abs=2e-3)
    assert at[20] == max(at.values())
    assert at[21] > at[40]  # y is still in the window of the next key
    assert at[40] == pytest.approx(-1.0, abs=2e-3)  # y left the window


# -- the outer learner --------------------------------------------------------------------------
def _np_score(a, beta=3.0, tau=0.6, kappa=10.0, prior=(0.4, 0.4, 0.2)):
    """Numpy transcription of the paper's blend and gate for one head: a (3, T)."""
    lo, hi = a.min(1, keepdims=True), a.max(1, keepdims=True)
    n = np.where(hi > lo, (a - lo) / np.where(hi > lo, hi - lo, 1), 0)
    m = max(1, int(0.1 * a.shape[1]))
    s = np.sort(n, 1)
    delta = s[:, -m:].mean(1) - s[:, :m].mean(1)
    logits = np.log(prior) + beta * delta
    w = np.exp(logits - logits.max())
    w /= w.sum()
    blend = w @ n
    spread = n.std(0)
    sn = (spread - spread.min()) / (spread.max() - spread.min())
    alpha = 1 / (1 + np.exp(-kappa * (sn - sn.mean() - tau)))
    return w, alpha, (1 - alpha) * blend + alpha * n.max(0)


def test_head_adaptive_blend_follows_each_heads_dispersion():
    rng = np.random.default_rng(1)
    t = 200
    spread = np.where(np.arange(t) % 10 == 0, 1.0, 0.0) + 0.01 * rng.normal(size=t)
    flat = 0.5 + 0.01 * rng.normal(size=(2, t))
    # min-max normalization maps every scale onto [0, 1]; what differs is how far apart its
    # top and bottom tenths are: a few clearly separated tokens (spread) against noise (flat)
    head0 = np.stack([spread, flat[0], flat[1]])  # the stable scale separates tokens
    head1 = np.stack([flat[1], flat[0], spread])  # the current scale does
    a = mx.array(np.stack([head0, head1], axis=1)[:, None].astype(np.float32))  # (3, 1, 2, T)
    out = nested_score(a[0], a[1], a[2])
    w = np.array(out.weights)[:, 0]  # (3, 2)
    for h, head in enumerate((head0, head1)):
        ref_w, ref_alpha, ref_star = _np_score(head)
        np.testing.assert_allclose(w[:, h], ref_w, rtol=1e-5)
        np.testing.assert_allclose(np.array(out.alpha[0, h]), ref_alpha, atol=1e-5)
        np.testing.assert_allclose(np.array(out.star[0, h]), ref_star, atol=1e-5)
    assert np.argmax(w[:, 0]) == 0 and np.argmax(w[:, 1]) == 2
    assert w[2, 1] > 0.2 + 0.2  # far above its prior of 0.2
    # a head where every scale is flat gets exactly the prior
    z = mx.zeros((1, 50))
    np.testing.assert_allclose(np.array(nested_score(z, z, z).weights)[:, 0], [0.4, 0.4, 0.2])


def test_surprise_gate_routes_disagreeing_tokens_to_their_strongest_scale():
    t = 100
    a = np.full((3, t), 0.5)
    a[:, 0], a[:, 1] = 0.0, 1.0  # anchors of every scale's range: all agree
    a[:, 50] = [1.0, 0.0, 0.0]  # only the stable scale finds token 50 anomalous
    a[:, 60] = [0.6, 0.6, 0.6]  # a token the scales agree on
    out = nested_score(*(mx.array(x[None].astype(np.float32)) for x in a))
    alpha, star, blend = (np.array(x[0]) for x in (out.alpha, out.star, out.blend))
    assert alpha[50] > 0.97 and star[50] == pytest.approx(1.0, abs=0.03)  # routed to max
    assert blend[50] < 0.5  # the blend alone would have ranked it low
    assert alpha[60] < 1e-2 and star[60] == pytest.approx(blend[60], abs=1e-2)
    assert star[50] > star[60]
    np.testing.assert_allclose(alpha, _np_score(a)[1], atol=1e-5)


def test_head_budgets_share_the_layer_after_the_safeguard():
    hi, lo = mx.full((10,), 0.9), mx.full((10,), 0.1)
    keep = head_budgets([hi, lo], 10, safeguard=0.2)
    # keep ratio 1/2: each head is guaranteed ⌊0.2 · 0.5 · 10⌋ = 1 token
    assert [len(x) for x in keep] == [9, 1]
    assert [len(x) for x in head_budgets([hi, lo], 10, safeguard=0.0)] == [10, 0]
    assert [len(x) for x in head_budgets([hi, lo], 10, safeguard=1.0)] == [5, 5]
    ragged = head_budgets([mx.arange(8) / 8, mx.array([0.95, 0.05, 0.99])], 5, safeguard=0.5)
    # keep ratio 5/11: floors ⌊0.5 · 5/11 · 8⌋ = 1 (token 7) and ⌊0.5 · 5/11 · 3⌋ = 0; then
    # the layer's best: 0.99, 0.95 (head 1), 0.75, 0.625 (head 0)
    assert [x.tolist() for x in ragged] == [[5, 6, 7], [0, 2]]
    assert all(x.dtype == mx.int32 for x in ragged)


# -- the cache ----------------------------------------------------------------------------------
def test_adaptive_budgets_are_per_head_and_respect_the_layer_total():
    k, v = kv_data(t=301, h=2, d=64, seed=1)
    c = NestedKVCache(budget=100, sinks=4, safeguard=0.2)
    with routed(tiny_model()):
        feed(c, k, v, (300,))
    sizes = c.body_sizes()
    assert c.ragged and sizes[0] != sizes[1]
    assert sum(sizes) == 2 * (100 - 4) + 2  # the layer's budget, then the new token per head
    assert min(sizes) - 1 >= int(0.2 * (96 / 300) * 300)  # the safeguard
    uniform = feed(NestedKVCache(budget=100, sinks=4, heads="uniform"), k, v, (300,))
    assert not uniform.ragged and uniform.body_sizes() == [97, 97]


def test_a_head_without_anomalies_can_lose_its_whole_body():
    """Without the safeguard a head whose keys are all alike (flat scores) yields its share to
    the other head; it keeps its sinks and refills, and statistics stay aligned."""
    rng = np.random.default_rng(2)
    keys = np.stack([rng.normal(size=(340, 32)), np.tile(rng.normal(size=32), (340, 1))])
    k, v = as_kv(keys)
    c = NestedKVCache(budget=60, sinks=4, safeguard=0.0, every=8)
    with routed(tiny_model()):
        feed(c, k, v, (300,))
    pending = c.offset - c.policy.meta()["seen"]  # tokens since the last compression
    assert c.ragged and sum(c.body_sizes()) <= 2 * (56 + 8)
    assert c.body_sizes()[1] == pending <= 8  # head 1 kept none of its body
    assert [a.shape[1] for a in c.policy._ac] == [x - pending for x in c.body_sizes()]


def test_batches_fall_back_to_uniform_budgets():
    k, v = kv_data(b=2, t=201, d=64)
    c = feed(NestedKVCache(budget=50), k, v, (200,))
    assert not c.ragged and c.size() == 51
    one = feed(NestedKVCache(budget=50, heads="uniform"), k[1:], v[1:], (200,))
    assert mx.array_equal(
        c.policy_view.body_positions()[0][1], one.policy_view.body_positions()[0][0]
    )


def test_kept_keys_stay_at_their_positions():
    """The same token at the same position keeps the same rotated key through evictions."""
    k, v = kv_data(t=260, d=64, seed=2)
    c = feed(NestedKVCache(budget=90, sinks=4, heads="uniform"), k, v, (150, 1, 1, 100))
    kk, _ = c.keys_and_values()
    assert mx.array_equal(kk[:, :, :4], k[:, :, :4])
    for h, p in enumerate(c.policy_view.body_positions()):
        assert np.all(np.diff(np.array(p[0])) > 0)
        assert mx.array_equal(kk[0, h, 4:], k[0, h, p[0]])  # fp16: the original keys
    coded = NestedKVCache(budget=90, sinks=4, bits=4, heads="uniform")
    feed(coded, k[:, :, :150], v[:, :, :150], (150,))
    before = {
        int(p): coded.policy_view.body_keys()[0][0, 0, i]
        for i, p in enumerate(np.array(coded.policy_view.body_positions()[0][0]))
    }
    feed(coded, k[:, :, 150:], v[:, :, 150:], (1, 1, 100))
    after = coded.policy_view.body_keys()[0][0, 0]
    kept = [
        (i, int(p))
        for i, p in enumerate(np.array(coded.policy_view.body_positions()[0][0]))
        if int(p) in before
    ]
    assert len(kept) > 10
    assert all(mx.array_equal(after[i], before[p]) for i, p in kept)


@pytest.mark.parametrize("heads", ["uniform", "adaptive"])
def test_bounded_chunked_prefill_in_a_model(heads):
    """Inside a model: eviction after every prompt chunk keeps each layer within its budget
    plus one chunk (per head on average, for adaptive budgets); offsets stay absolute."""
    model = tiny_model("llama")
    prompt = mx.random.randint(0, 512, (1, 300), key=mx.random.key(0))
    caches = make_cache(model, NestedKVCache(budget=96, sinks=4, every=16, heads=heads))
    held = []
    with routed(model):
        for s in range(0, 300, 64):
            model(prompt[:, s : s + 64], cache=caches)
            held += [c.protected() + sum(c.body_sizes()) / 2 for c in caches]
        out = model(prompt[:, -1:], cache=caches)
        for _ in range(40):
            out = model(mx.argmax(out[:, -1:], axis=-1), cache=caches)
    assert all(c.offset == 341 for c in caches)
    assert max(held) <= 96 + 64
    assert all(c.protected() + sum(c.body_sizes()) / 2 <= 96 + 16 for c in caches)
    assert out.shape == (1, 1, 512)


def test_every_bounds_decode_and_none_compresses_only_the_prompt():
    k, v = kv_data(t=400, d=64)
    paper = feed(NestedKVCache(budget=64, heads="uniform"), k, v, (200,))
    extended = feed(NestedKVCache(budget=64, heads="uniform", every=8), k, v, (200,))
    assert paper.size() == 64 + 200  # prefill compressed once, decode tokens appended
    assert extended.size() <= 64 + 8


def test_scores_use_keys_only_and_are_deterministic():
    k, v = kv_data(t=300, d=64, seed=4)
    runs = []
    for seed in (0, 1):
        c = NestedKVCache(budget=60, sinks=4)
        with routed(tiny_model()):
            for s in range(0, 300, 50):
                c.update_and_fetch(k[:, :, s : s + 50], v[:, :, s : s + 50])
                q = mx.random.normal((1, 4, 3, 64), key=mx.random.key(seed + s))
                c.attend(q.astype(mx.float16), 0.1, mask="causal")  # queries differ per run
            c.update_and_fetch(k[:, :, :1], v[:, :, :1])
        runs.append(c)
    a, b = runs
    assert all(
        mx.array_equal(x, y)
        for x, y in zip(a.policy_view.body_positions(), b.policy_view.body_positions())
    )
    sa, sb = a.policy.state(), b.policy.state()
    assert sa.keys() == sb.keys() and all(mx.array_equal(sa[n], sb[n]) for n in sa)


def test_state_round_trip_keeps_the_statistics(tmp_path):
    k, v = kv_data(t=500, d=64, seed=5)
    model = tiny_model()
    with routed(model):
        c = feed(
            NestedKVCache(budget=80, sinks=4, window=4, every=8),
            k[:, :, :300],
            v[:, :, :300],
            (120, 150),
        )
        assert c.policy.state()["recent"].shape == (1, 2, 63, 64)
        path = tmp_path / "c.safetensors"
        save_cache(path, [c])
        (d,) = load_cache(path)
        assert d.policy.meta() == c.policy.meta() and d.ragged == c.ragged
        for other in (c, d):
            feed(other, k[:, :, 300:], v[:, :, 300:], (90, 1, 1, 50))
    assert all(
        mx.array_equal(x, y)
        for x, y in zip(c.policy_view.body_positions(), d.policy_view.body_positions())
    )
    sc, sd = c.policy.state(), d.policy.state()
    assert sc.keys() == sd.keys() and all(mx.array_equal(sc[n], sd[n]) for n in sc)
    assert c.policy.nbytes == sum(a.nbytes for a in sc.values()) > 0


def test_composes_with_any_per_token_codec():
    k, v = kv_data(t=400, d=64)
    policy = NestedKVPolicy(budget=100, every=8, heads="uniform")
    c = VeloxCache(Uniform(4), Uniform(4), sinks=4, window=16, policy=policy)
    feed(c, k, v, (128, 1, 1, 128))
    assert c.size() <= 100 + 8 and c.offset == 400
    seen = c.policy.meta()["seen"]
    c.trim(12)
    assert c.offset < seen  # the trim reached tokens the statistics already hold
    feed(c, k[:, :, :40], v[:, :, :40])
    assert c.size() <= 100 + 8 and c.offset == 428
    pending = c.offset - c.policy.meta()["seen"]
    assert [a.shape[1] for a in c.policy._ac] == [x + 16 - pending for x in c.body_sizes()]
    assert type(c).from_config(c.config()).policy.config() == policy.config()
    q = mx.random.normal((1, 4, 1, 64)).astype(mx.float16)
    kk, vv = c.keys_and_values()
    ref = mx.fast.scaled_dot_product_attention(q, kk, vv, scale=0.1)
    assert rel_error(c.attend(q, 0.1), ref) < 1e-2
    assert make("nestedkv:budget=128,bits=4,recent=32").policy.recent == 32


def test_four_bit_setting_against_mlx_q4():
    """Below the budget nothing is evicted: the 4-bit setting's attention error is no worse
    than mlx's 4-bit group-64 quantization and it holds no more bytes than QuantizedKVCache
    (per token it stores 4 B more, its int32 positions, but with less allocation slack).
    Beyond the budget its bytes stay bounded (its error then is eviction's, not compared)."""
    for t in (1000, 4096):
        for seed in (0, 1):
            k, v = kv_data(t=t, seed=seed)
            mq, c = QuantizedKVCache(group_size=64, bits=4), NestedKVCache(**FOUR_BIT)
            with routed(tiny_model()):
                fill_chunks([mq, c], k, v)
            mx.eval(c.state, mq.state)
            if t > FOUR_BIT["budget"]:
                assert c.nbytes <= 0.4 * mq.nbytes, (c.nbytes, mq.nbytes)
                continue
            assert c.nbytes <= mq.nbytes, (c.nbytes, mq.nbytes)
            ours, theirs = attention_errors_vs_mlx_quant(c, k, v, seed=seed, stride=100)
            assert ours <= theirs, (seed, ours, theirs)


def test_recommended_settings():
    assert FP16 == {"budget": 1024} and FOUR_BIT == {"budget": 1024, "bits": 4}
    c = NestedKVCache(**FOUR_BIT)
    assert c.tiers[0].key_codec.bits == 4 and c.tiers[0].key_codec.group == 64
    assert c.sinks == 4 and c.policy.heads == "adaptive" and c.policy.every is None
    p = c.policy
    assert (p.recent, p.block, p.beta, p.tau, p.kappa, p.prior, p.safeguard) == (
        64,
        None,
        3.0,
        0.6,
        10.0,
        (0.4, 0.4, 0.2),
        0.2,
    )
