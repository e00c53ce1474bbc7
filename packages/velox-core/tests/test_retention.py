"""Eviction machinery: bounded chunked prefill, absolute positions, per-head budgets."""

import mlx.core as mx
import numpy as np
import pytest

from velox_core import RetentionPolicy, Uniform, VeloxCache, load_cache, save_cache
from velox_core.cache.attention import attend
from velox_core.policy import base, top_k_sorted
from velox_core.registry import register
from velox_testing import kv_data, rel_error


@register
class EveryOther(RetentionPolicy):
    """Keeps even positions first (a deterministic, non-recency choice for tests)."""

    name = "every-other-test"

    def score(self, view):
        return [
            None if p is None else (p % 2 == 0).astype(mx.float32) * 1e6 + p
            for p in view.body_positions()
        ]


@register
class Ragged(RetentionPolicy):
    """Different budgets per head: head 0 keeps k tokens, head 1 keeps k // 2."""

    name = "ragged-test"

    def select(self, view, k):
        pos = view.body_positions()
        return [
            top_k_sorted(pos[0][0].astype(mx.float32), k),
            top_k_sorted(pos[1][0].astype(mx.float32), k // 2),
        ]


def feed(cache, k, v, chunk):
    sizes = []
    for s in range(0, k.shape[2], chunk):
        cache.update_and_fetch(k[:, :, s : s + chunk], v[:, :, s : s + chunk])
        sizes.append(cache.size())
    return sizes


def test_chunked_prefill_stays_within_budget_plus_a_chunk():
    k, v = kv_data(t=1024)
    c = VeloxCache(Uniform(4), Uniform(4), sinks=4, window=8, policy=RetentionPolicy(budget=100))
    sizes = feed(c, k, v, 128)
    assert max(sizes) <= 100 + 128
    assert c.offset == 1024
    c.update_and_fetch(k[:, :, :1], v[:, :, :1])  # the first decode step cuts back
    assert c.size() == 101
    assert c.offset == 1025


def test_recency_keeps_sinks_and_the_latest_tokens_at_their_positions():
    k, v = kv_data(t=600)
    c = VeloxCache(sinks=4, window=16, policy=RetentionPolicy(budget=64))  # lossless
    feed(c, k, v, 100)
    c.update_and_fetch(k[:, :, :1], v[:, :, :1])
    pos = np.array(c.policy_view.body_positions()[0][0])
    # cut back to 64 - 4 sinks - 16 window = 44 body tokens (540..583), then the new token
    # pushed 584 out of the window into the body
    assert list(pos) == list(range(540, 585))
    kk, _ = c.keys_and_values()
    # the same token at the same position keeps the same rotated key
    body = kk[:, :, 4 : 4 + len(pos)]
    assert mx.array_equal(body, k[:, :, mx.array(pos)])
    assert mx.array_equal(kk[:, :, :4], k[:, :, :4])


def test_positions_survive_lossy_eviction():
    k, v = kv_data(t=512)
    c = VeloxCache(Uniform(8), Uniform(8), policy=EveryOther(budget=200))
    feed(c, k, v, 128)
    before = {
        int(p): c.policy_view.body_keys()[0][0, 0, i]
        for i, p in enumerate(np.array(c.policy_view.body_positions()[0][0]))
    }
    c.update_and_fetch(k[:, :, :1], v[:, :, :1])
    pos = np.array(c.policy_view.body_positions()[0][0])
    assert len(pos) == 201 and np.all(np.diff(pos) > 0)  # 200 kept + the new token
    assert np.mean(pos % 2 == 0) > 0.9
    keys = c.policy_view.body_keys()[0][0, 0]
    for i, p in enumerate(pos):
        if int(p) in before:
            assert mx.array_equal(keys[i], before[int(p)])


def test_decode_eviction_every_n_steps_bounds_long_generations():
    k, v = kv_data(t=400)
    c = VeloxCache(Uniform(4), Uniform(4), policy=RetentionPolicy(budget=64, every=16))
    feed(c, k, v, 1)
    assert c.size() <= 64 + 16 and c.offset == 400
    unbounded = VeloxCache(Uniform(4), Uniform(4), policy=RetentionPolicy(budget=64))
    feed(unbounded, k[:, :, :200], v[:, :, :200], 100)
    base._WARNED.discard(unbounded.policy.name)
    with pytest.warns(UserWarning, match="budget=64 bounds the prompt only") as seen:
        feed(unbounded, k[:, :, 200:], v[:, :, 200:], 1)
    assert len(seen) == 1  # once, however long the generation
    assert unbounded.size() > 64 + 150  # without `every`, decode tokens accumulate


def test_memory_is_freed():
    k, v = kv_data(h=4, t=2048)
    full = VeloxCache(Uniform(4), Uniform(4))
    kept = VeloxCache(Uniform(4), Uniform(4), policy=RetentionPolicy(budget=256))
    feed(full, k, v, 512)
    feed(kept, k, v, 512)
    kept.update_and_fetch(k[:, :, :1], v[:, :, :1])
    mx.eval(full.state, kept.state)
    assert kept.size() <= 257
    assert kept.nbytes < 0.2 * full.nbytes


def test_attention_equals_attention_over_the_kept_tokens():
    k, v = kv_data(t=300)
    c = VeloxCache(policy=EveryOther(budget=120), sinks=2, window=4)
    feed(c, k, v, 100)
    c.update_and_fetch(k[:, :, 299:300], v[:, :, 299:300])
    kk, vv = c.keys_and_values()
    q = mx.random.normal((1, 4, 1, 128)).astype(mx.float16)
    ref = mx.fast.scaled_dot_product_attention(q, kk, vv, scale=0.1)
    assert rel_error(c.attend(q, 0.1), ref) < 2e-3


def test_per_head_budgets_store_no_padding_and_attend_per_head():
    from velox_core import routed
    from velox_testing import tiny_model

    k, v = kv_data(t=400)
    c = VeloxCache(Uniform(8), Uniform(8), sinks=2, window=4, policy=Ragged(budget=100))
    with routed(tiny_model()):
        feed(c, k, v, 200)
        c.update_and_fetch(k[:, :, :1], v[:, :, :1])
    assert c.ragged and c.body_sizes() == [95, 48]  # 94 and 47 kept + the new token
    dense = VeloxCache(
        Uniform(8), Uniform(8), sinks=2, window=4, policy=RetentionPolicy(budget=100)
    )
    feed(dense, k, v, 200)
    dense.update_and_fetch(k[:, :, :1], v[:, :, :1])
    mx.eval(c.state, dense.state)
    assert c.nbytes < 0.8 * dense.nbytes  # head 1 holds half the tokens, nothing padded
    q = mx.random.normal((1, 4, 1, 128)).astype(mx.float16)
    out = c.attend(q, 0.1)
    for h in range(2):
        segs = c._head_segments(h)
        ref = attend(q[:, 2 * h : 2 * h + 2], segs, 0.1, None, None, 16)
        assert rel_error(out[:, 2 * h : 2 * h + 2], ref) < 1e-6
    with pytest.raises(ValueError, match="routed"):
        c.update_and_fetch(k[:, :, :1], v[:, :, :1])


def test_state_and_files_keep_evicted_caches(tmp_path):
    k, v = kv_data(t=300)
    c = VeloxCache(Uniform(4), Uniform(4), window=4, policy=RetentionPolicy(budget=64))
    feed(c, k, v, 100)
    c.update_and_fetch(k[:, :, :1], v[:, :, :1])
    path = tmp_path / "c.safetensors"
    save_cache(path, [c])
    (d,) = load_cache(path)
    assert d.size() == c.size() and d.offset == c.offset
    assert mx.array_equal(d.policy_view.body_positions()[0], c.policy_view.body_positions()[0])
    q = mx.random.normal((1, 4, 1, 128)).astype(mx.float16)
    assert mx.array_equal(d.attend(q, 0.1), c.attend(q, 0.1))


def test_bad_policy_settings():
    with pytest.raises(ValueError, match="budget"):
        VeloxCache(sinks=4, window=60, policy=RetentionPolicy(budget=64))
    with pytest.raises(ValueError, match="per-token"):
        VeloxCache(Uniform(4, axis="channel", group=32), policy=RetentionPolicy(budget=64))
    with pytest.raises(ValueError, match="budget"):
        RetentionPolicy(budget=0)
    with pytest.raises(TypeError, match="every"):
        RetentionPolicy(budget=10, every=1.5)


def test_per_head_storage_survives_state_and_files(tmp_path):
    from velox_core import routed
    from velox_testing import tiny_model

    k, v = kv_data(t=400)
    c = VeloxCache(Uniform(8), Uniform(8), sinks=2, window=4, policy=Ragged(budget=100))
    c.set_storage_dtype(mx.float16)
    with routed(tiny_model()):
        feed(c, k, v, 200)
        c.update_and_fetch(k[:, :, :1], v[:, :, :1])
        path = tmp_path / "r.safetensors"
        save_cache(path, [c])
        (d,) = load_cache(path)
        assert d.ragged and d.body_sizes() == c.body_sizes()
        assert d.storage_dtype == mx.float16 and d._io_dtype == c._io_dtype
        q = mx.random.normal((1, 4, 1, 128)).astype(mx.float16)
        assert mx.array_equal(d.attend(q, 0.1), c.attend(q, 0.1))
    with pytest.raises(ValueError, match="routed"):
        d.update_and_fetch(k[:, :, :1], v[:, :, :1])
    assert d.offset == c.offset  # refused before anything changed


def test_protected_tokens_are_the_sinks_and_window():
    k, v = kv_data(t=100)
    c = VeloxCache(Uniform(4), Uniform(4), sinks=3, window=5, policy=RetentionPolicy(budget=50))
    c.update_and_fetch(k, v)
    sinks, window = c.policy_view.protected()
    assert mx.array_equal(sinks.keys, k[:, :, :3]) and mx.array_equal(window.keys, k[:, :, -5:])
    assert mx.array_equal(sinks.values, v[:, :, :3]) and mx.array_equal(window.values, v[:, :, -5:])
    assert sinks.positions.tolist() == [0, 1, 2]
    assert window.positions.tolist() == [95, 96, 97, 98, 99]
    assert c.policy_view.sink_count() == 3


def test_set_body_values_recodes_the_named_body_tokens():
    """A policy that merges values (velox-cam) writes them back through the value codec; keys,
    positions and the other tokens stay, and the write is refused outside the body."""
    k, v = kv_data(t=60, d=64)
    for codec, tol in ((None, 1e-3), (Uniform(8), 5e-2)):
        c = VeloxCache(codec, codec, sinks=4, policy=RetentionPolicy(budget=40))
        c.update_and_fetch(k, v)
        keys0, vals0 = c.keys_and_values()
        new = mx.ones((1, 2, 3, 64)) * 2.5
        c.set_body_values(5, new)
        keys1, vals1 = c.keys_and_values()
        assert mx.array_equal(keys0, keys1)
        assert rel_error(vals1[:, :, 9:12], new) < tol  # body token 5 is position 9
        assert mx.array_equal(vals1[:, :, :9], vals0[:, :, :9])
        assert mx.array_equal(vals1[:, :, 12:], vals0[:, :, 12:])
        with pytest.raises(ValueError, match="not within the 56 body tokens"):
            c.set_body_values(55, new)
        with pytest.raises(ValueError, match=r"must be \(batch=1, kv_heads=2, n, value_dim=64\)"):
            c.set_body_values(0, mx.ones((1, 3, 2, 64)))
    with pytest.raises(ValueError, match="needs a cache with a retention policy"):
        VeloxCache().set_body_values(0, new)


class OddTokens(RetentionPolicy):
    """Attends, at a decode step, the body tokens at odd indices only (a sparse decode)."""

    name = "odd-tokens-test"

    def __init__(self, budget=None, every=None):
        super().__init__(budget, every)
        self.calls = 0

    def decode_segments(self, view, queries, scale):
        self.calls += 1
        segs = view.segments()
        odd = mx.arange(1, segs[1].tokens, 2)  # sinks | body | window: the body's odd tokens
        body = segs[1]
        picked = type(body)(
            body.key_codec, body.keys.take(odd), body.value_codec, body.values.take(odd)
        )
        return [segs[0], picked, segs[2]]


def test_a_policy_picks_the_tokens_a_decode_step_attends():
    """RetentionPolicy.decode_segments: a single decode query attends the segments the policy
    returns (here sinks, the body's odd tokens and the window), one softmax over them; calls
    of several queries, and the base policy (None), attend every stored token."""
    k, v = kv_data(t=60)
    pol = OddTokens()
    c = VeloxCache(sinks=4, window=6, policy=pol)
    c.update_and_fetch(k, v)
    kk, vv = c.keys_and_values()
    q = mx.random.normal((1, 4, 1, 128), key=mx.random.key(3)).astype(mx.float16)
    keep = [*range(4), *range(5, 54, 2), *range(54, 60)]  # sinks | odd body tokens | window
    idx = mx.array(keep)
    got = c.attend(q, scale=0.125)
    ref = attend(q, [_plain(kk[:, :, idx], vv[:, :, idx])], 0.125)
    full = attend(q, [_plain(kk, vv)], 0.125)
    assert pol.calls == 1
    assert rel_error(got, ref) < 1e-3 and rel_error(got, full) > 1e-2
    q3 = mx.random.normal((1, 4, 3, 128), key=mx.random.key(4)).astype(mx.float16)
    assert (
        rel_error(c.attend(q3, 0.125, mask="causal"), attend(q3, c.segments(), 0.125, "causal"))
        < 1e-3
    )
    assert pol.calls == 1  # not asked for several queries
    base_c = VeloxCache(sinks=4, window=6, policy=RetentionPolicy())
    base_c.update_and_fetch(k, v)
    assert rel_error(base_c.attend(q, scale=0.125), full) < 1e-3


def _plain(k, v):
    from velox_core.cache.attention import Segment
    from velox_core.codec.identity import Identity

    ident = Identity()
    return Segment(ident, ident.encode(k), ident, ident.encode(v))
