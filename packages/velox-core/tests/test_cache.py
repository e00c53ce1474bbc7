"""VeloxCache mechanics: segments, tiers, masks, attention modes, memory, bad input."""

import math

import mlx.core as mx
import pytest
from mlx_lm.models.cache import KVCache

from velox_core import Identity, Tier, Uniform, UniformCache, VeloxCache
from velox_core.cache.attention import attend
from velox_testing import kv_data, rel_error


def sdpa(q, k, v, scale, mask=None, sinks=None):
    return mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask, sinks=sinks)


@pytest.mark.parametrize("flush,segments", [(1, [4, 264, 32]), (64, [4, 214, 82])])
def test_lossless_cache_equals_fp16_attention_in_every_mode(flush, segments):
    """The window passes tokens to the body ``flush`` at a time: after 250 tokens at once and
    50 one by one, the default quantum (64) has not been reached again; 1 passes each."""
    k, v = kv_data(t=300)
    c = VeloxCache(window=32, sinks=4, flush=flush)
    c.update_and_fetch(k[:, :, :250], v[:, :, :250])
    for i in range(250, 300):
        c.update_and_fetch(k[:, :, i : i + 1], v[:, :, i : i + 1])
    assert [s.tokens for s in c.segments()] == segments
    kk, vv = c.keys_and_values()
    assert mx.array_equal(kk, k) and mx.array_equal(vv, v)
    scale = 1 / math.sqrt(128)
    for lq, mask in ((1, None), (5, "causal"), (40, "causal")):
        q = mx.random.normal((1, 4, lq, 128), key=mx.random.key(lq)).astype(mx.float16)
        ref = sdpa(q.astype(mx.float32), k.astype(mx.float32), v.astype(mx.float32), scale, mask)
        assert rel_error(c.attend(q, scale, mask), ref) < 2e-3


def test_attention_sinks_logits_and_array_masks():
    k, v = kv_data(t=64)
    c = VeloxCache(window=8)
    c.update_and_fetch(k, v)
    q = mx.random.normal((1, 4, 3, 128)).astype(mx.float32)
    sinks = mx.array([0.5, -1.0, 2.0, 0.0])
    mask = mx.random.uniform(shape=(1, 1, 3, 64)) > 0.3
    mask[..., -1] = True
    ref = sdpa(q, k.astype(mx.float32), v.astype(mx.float32), 0.1, mask, sinks)
    got = attend(q, c.segments(), 0.1, mask, sinks, fused_above=16)
    assert rel_error(got, ref) < 1e-4
    with pytest.raises(ValueError, match="mask"):
        attend(q, c.segments(), 0.1, mask[..., :10], None, fused_above=16)


def test_window_and_block_codec_keep_pending_tokens_exact():
    k, v = kv_data(t=70)
    c = UniformCache(bits=2, group=32, key_axis="channel", value_axis="channel", window=4)
    c.update_and_fetch(k, v)
    segs = c.segments()
    assert [s.tokens for s in segs] == [64, 6]  # 6 = window 4 + 2 waiting for a whole block
    kk, _ = c.keys_and_values()
    assert mx.array_equal(kk[:, :, 64:], k[:, :, 64:])


@pytest.mark.parametrize(
    "kw",
    [
        {"bits": 4},
        {"bits": 4, "sinks": 3},
        {"bits": 2, "group": 32, "key_axis": "channel", "value_axis": "channel"},
        {"bits": 3, "group": 16, "key_axis": "channel", "sinks": 2},
    ],
)
def test_without_a_window_new_tokens_go_straight_to_the_codes(monkeypatch, kw):
    """window=0: tokens skip the window (no copy through it) and the cache holds exactly the
    records, segments and attention it holds when they pass through the window."""
    k, v = kv_data(t=80)
    q = mx.random.normal((1, 2 * k.shape[1], 1, k.shape[3]), key=mx.random.key(3))
    chunks = [(0, 37), (37, 38), (38, 39), (39, 71), (71, 72), (72, 80)]

    def run():
        c = UniformCache(window=0, **kw)
        for a, z in chunks:
            c.update_and_fetch(k[:, :, a:z], v[:, :, a:z])
        return c

    direct = run()
    assert direct._direct() or direct.stored.window[0].tokens > 0
    monkeypatch.setattr(VeloxCache, "_direct", lambda self: False)
    through = run()
    assert [s.tokens for s in direct.segments()] == [s.tokens for s in through.segments()]
    assert len(direct.state) == len(through.state)
    for a, b in zip(direct.state, through.state):
        if isinstance(a, mx.array):
            assert a.shape == b.shape and mx.array_equal(a, b)
        else:
            assert a == b
    assert mx.array_equal(direct.attend(q, 0.1), through.attend(q, 0.1))


def test_attend_rejects_queries_of_another_shape():
    k, v = kv_data(t=20)
    c = UniformCache(bits=4)
    c.update_and_fetch(k, v)
    b, h, _, d = k.shape
    for bad in [(b, 2 * h, 1, d // 2), (b, h + 1, 1, d), (b + 1, h, 1, d), (2 * h, 1, d)]:
        with pytest.raises(ValueError, match="attend: queries"):
            c.attend(mx.zeros(bad, mx.float16), 0.1)


def test_trim_splits_a_block_and_restores_its_tokens():
    k, v = kv_data(t=96)
    c = UniformCache(bits=8, group=32, key_axis="channel")
    c.update_and_fetch(k, v)
    c.trim(20)
    assert c.offset == 76 and c.size() == 76
    assert [s.tokens for s in c.segments()] == [64, 12]
    kk, _ = c.keys_and_values()
    assert rel_error(kk, k[:, :, :76]) < 0.01
    c.update_and_fetch(k[:, :, 76:], v[:, :, 76:])
    # 32 tokens wait in the window: fewer than the flush quantum (64)
    assert c.size() == 96 and [s.tokens for s in c.segments()] == [64, 32]
    c.update_and_fetch(k[:, :, :33], v[:, :, :33])
    # 65 wait: a quantum (two key groups) moves and one token stays as given
    assert c.size() == 129 and [s.tokens for s in c.segments()] == [128, 1]


def test_age_tiers_recode_once_and_keep_order():
    k, v = kv_data(t=400)
    tiers = [
        Tier(Uniform(8), Uniform(8), span=64),
        Tier(Uniform(4), Uniform(4), span=128),
        Tier(Uniform(2), Uniform(2)),
    ]
    c = VeloxCache(tiers=tiers, window=16, sinks=2)
    for i in range(0, 400, 25):
        c.update_and_fetch(k[:, :, i : i + 25], v[:, :, i : i + 25])
    sizes = [s.tokens for s in c.segments()]
    assert sizes == [2, 400 - 2 - 16 - 64 - 128, 128, 64, 16]
    kk, _ = c.keys_and_values()
    # error grows with age: the oldest tier (2 bits) is the worst
    e_old = rel_error(kk[:, :, 2:100], k[:, :, 2:100])
    e_mid = rel_error(kk[:, :, 200:300], k[:, :, 200:300])
    e_new = rel_error(kk[:, :, 330:380], k[:, :, 330:380])
    assert e_old > e_mid > e_new
    assert c.offset == 400


def test_tier_validation():
    with pytest.raises(TypeError, match=r"tiers\[0\].span"):
        VeloxCache(tiers=[Tier(Uniform(8), Uniform(8)), Tier(Uniform(2), Uniform(2))])
    with pytest.raises(ValueError, match="span"):
        VeloxCache(tiers=[Tier(Uniform(8), Uniform(8), span=10)])
    with pytest.raises(ValueError, match="either"):
        VeloxCache(Uniform(4), tiers=[Tier(Uniform(2), Uniform(2))])
    with pytest.raises(TypeError):
        VeloxCache(key_codec="uniform")


def test_uniform_4bit_2048_tokens_resident_bytes():
    """Done-when of the core issue: <= 0.3 of the fp16 cache at 2,048 tokens (group 64)."""
    k, v = kv_data(h=8, t=2048)
    c, ref = UniformCache(bits=4, group=64), KVCache()
    c.update_and_fetch(k, v)
    ref.update_and_fetch(k, v)
    mx.eval(c.state, ref.state)
    ratio = c.nbytes / ref.nbytes
    assert ratio <= 0.3
    assert ratio == pytest.approx((4 / 16) + 2 * 2 / (64 * 2), rel=1e-6)  # codes + scale, zero


def test_nbytes_counts_capacity_and_logical_excludes_it():
    k, v = kv_data(t=300)
    c = UniformCache(bits=4)
    c.update_and_fetch(k, v)
    mx.eval(c.state)
    arrays = [a for a in c.state[1:]]
    assert c.logical_nbytes == sum(a.nbytes for a in arrays)
    assert c.nbytes > c.logical_nbytes  # 300 tokens in a 512-token buffer


def test_exact_stores_stay_exact_and_ordered_through_appends_and_drops():
    """A store sized exactly (the sinks' and window's) holds exactly its tokens after every
    append and drop, in order: what a sliding window does on every decode step."""
    from velox_core.cache.store import PackedStore

    ident = Identity()
    x = mx.arange(2 * 3 * 40 * 4, dtype=mx.float32).reshape(2, 3, 40, 4)
    s = PackedStore(1)
    s.append(ident.encode(x[:, :, :10]))
    assert s.capacity == s.tokens == 10
    for i in range(10, 40):
        s.append(ident.encode(x[:, :, i : i + 1]))
        assert s.capacity == s.tokens == 11
        s.drop_front(1)
        assert s.capacity == s.tokens == 10
        assert mx.array_equal(s.view().data["x"], x[:, :, i - 9 : i + 1]).item()
    s.append(ident.encode(x[:, :, :5]))
    assert s.capacity == s.tokens == 15
    assert mx.array_equal(s.view().data["x"][:, :, 10:], x[:, :, :5]).item()


def test_bad_settings_raise_clear_errors():
    with pytest.raises(ValueError, match="bits"):
        UniformCache(bits=9)
    with pytest.raises(ValueError, match="bits"):
        UniformCache(bits=1)
    with pytest.raises(TypeError, match="bits"):
        UniformCache(bits=4.5)
    with pytest.raises(ValueError, match="unknown parameter 'bitz'"):
        UniformCache(bitz=4)
    with pytest.raises(ValueError, match="axis"):
        UniformCache(key_axis="row")
    with pytest.raises(ValueError, match="window"):
        UniformCache(window=-1)
    c = UniformCache(bits=4, group=64)
    k, v = kv_data(t=4, d=80)
    with pytest.raises(ValueError, match="uniform: group=64 must divide the key head dim 80"):
        c.update_and_fetch(k, v)
    assert c.offset == 0


def test_keys_values_mismatch_and_dims():
    c = VeloxCache()
    k, v = kv_data(t=4)
    with pytest.raises(ValueError, match="agree"):
        c.update_and_fetch(k, v[:, :1])
    with pytest.raises(ValueError, match="4 dimensions"):
        c.update_and_fetch(k[0, 0], v[0, 0])
    with pytest.raises(TypeError, match="dtype"):
        c.update_and_fetch(k.astype(mx.int8), v)
    c.update_and_fetch(k, v)
    k2, v2 = kv_data(t=4, d=64)
    with pytest.raises(ValueError, match="do not match"):
        c.update_and_fetch(k2, v2)
    with pytest.raises(ValueError, match="cannot trim"):
        c.trim(5)


def test_identity_codec_keeps_dtype():
    for dt in (mx.float16, mx.bfloat16, mx.float32):
        x = mx.random.normal((1, 1, 3, 8)).astype(dt)
        assert Identity().decode(Identity().encode(x)).dtype == dt


def test_filter_extend_merge():
    k, v = kv_data(b=3, t=50)
    c = UniformCache(bits=8)
    c.update_and_fetch(k, v)
    q = mx.random.normal((3, 4, 1, 128)).astype(mx.float16)
    full = c.attend(q, 0.1)
    parts = [c.extract(i) for i in range(3)]
    merged = UniformCache.stack(parts)
    assert rel_error(merged.attend(q, 0.1), full) < 5e-4
    c.filter([0, 2])
    assert rel_error(c.attend(q[mx.array([0, 2])], 0.1), full[mx.array([0, 2])]) < 5e-4
    short = UniformCache(bits=8)
    short.update_and_fetch(k[:1, :, :10], v[:1, :, :10])
    with pytest.raises(ValueError, match="same tokens"):
        parts[0].extend(short)
    with pytest.raises(ValueError, match="same class and settings"):
        parts[0].extend(UniformCache(bits=4))


def test_partials_merge_to_the_joint_softmax():
    from velox_core.cache.attention import merge_partials, partial

    k, v = kv_data(t=200)
    c = UniformCache(bits=8, window=16, sinks=4)
    c.update_and_fetch(k, v)
    q = mx.random.normal((1, 2, 3, 128))
    merged = merge_partials([partial(q, s) for s in c.segments()])
    segs = c.segments()
    kk = mx.concatenate([s.key_codec.decode(s.keys).astype(mx.float32) for s in segs], axis=2)
    vv = mx.concatenate([s.value_codec.decode(s.values).astype(mx.float32) for s in segs], axis=2)
    p = mx.softmax(q @ mx.swapaxes(kk, -1, -2), axis=-1)
    assert rel_error(merged, p @ vv) < 1e-5


def test_partials_merge_for_any_reference_max():
    """A partial may be taken against any max at or below its scores' (the tensor-core kernel
    raises its max lazily): the merged softmax is the same, and one partial alone is o / l."""
    from velox_core.cache.attention import merge_partials, partial

    k, v = kv_data(t=120)
    c = UniformCache(bits=8, window=16)
    c.update_and_fetch(k, v)
    q = mx.random.normal((1, 2, 3, 128))
    parts = [partial(q, s) for s in c.segments()]
    o, m, l = parts[0]
    shifted = (o * math.exp(3.0), m - 3.0, l * math.exp(3.0))
    assert rel_error(merge_partials([shifted, *parts[1:]]), merge_partials(parts)) < 1e-5
    assert rel_error(merge_partials([shifted]), o / l) < 1e-6


@pytest.mark.parametrize(
    "kw",
    [
        {"bits": 4},
        {"bits": 4, "sinks": 3, "window": 5},
        {"bits": 2, "group": 32, "key_axis": "channel", "window": 8, "flush": 40},
        {"bits": 4, "window": 0, "flush": 1},
        {"bits": 3, "group": 32, "window": 0, "flush": 1, "sinks": 4},
    ],
)
def test_decode_steps_written_into_the_window_in_place_hold_what_the_general_path_holds(
    monkeypatch, kw
):
    """A decode step's fast paths (the token written into the window's buffer, or coded
    straight into tier 0's buffers where every token is coded on arrival) leave the cache as
    the general path does: same segments, same records, same state, same decoded tokens,
    across the buffers' growth at 256 tokens."""
    k, v = kv_data(t=260)
    direct = VeloxCache._write_direct
    taken = []

    def counted(self, keys, values):
        taken.append(direct(self, keys, values))
        return taken[-1]

    def run():
        c = UniformCache(**kw)
        c.update_and_fetch(k[:, :, :100], v[:, :, :100])
        for i in range(100, 260):
            c.update_and_fetch(k[:, :, i : i + 1], v[:, :, i : i + 1])
        return c

    monkeypatch.setattr(VeloxCache, "_write_direct", counted)
    fast = run()
    if kw.get("flush") == 1:
        assert taken.count(True) >= 150  # the direct path ran (the first steps may not)
    monkeypatch.setattr(VeloxCache, "_write_window", lambda self, k, v: False)
    monkeypatch.setattr(VeloxCache, "_write_direct", lambda self, k, v: False)
    general = run()
    for a, b in zip(fast.keys_and_values(), general.keys_and_values(), strict=True):
        assert mx.array_equal(a, b)
    assert fast.offset == general.offset == 260
    assert [s.tokens for s in fast.segments()] == [s.tokens for s in general.segments()]
    for a, b in zip(fast.state, general.state, strict=True):
        assert a == b if isinstance(a, str) else mx.array_equal(a, b)


def test_flush_is_a_setting_of_every_cache_and_survives_its_config():
    from velox_core import make

    c = make("uniform:bits=4,flush=8")
    assert c.flush == 8 and c.config()["flush"] == 8 and c.fresh().flush == 8
    assert UniformCache(bits=4).flush == 64 and VeloxCache(window=4).flush == 64
    k, v = kv_data(t=20)
    c.update_and_fetch(k[:, :, :3], v[:, :, :3])
    for i in range(3, 20):
        c.update_and_fetch(k[:, :, i : i + 1], v[:, :, i : i + 1])
    assert [s.tokens for s in c.segments()] == [16, 4]  # 3 + 5 steps, 8 more, then 4 wait
    with pytest.raises(ValueError, match="flush"):
        UniformCache(bits=4, flush=0)


def test_a_flush_rounded_up_to_the_codecs_block_is_warned_and_a_multiple_is_not():
    """A flush the window cannot honour (below the codecs' block: keys coded 32 tokens a
    group along channels) is rounded up with a warning naming the block; flushes that are
    multiples of it, the default and per-token codecs say nothing."""
    import warnings

    k, v = kv_data(t=40)
    with pytest.warns(UserWarning, match=r"flush=1 is rounded up to 32 tokens .*multiple of 32"):
        c = UniformCache(bits=4, group=32, key_axis="channel", flush=1)
        c.update_and_fetch(k, v)
    assert [s.tokens for s in c.segments()] == [32, 8]  # 8 wait for a whole block
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for kw in ({}, {"flush": 32}, {"flush": 64}):
            UniformCache(bits=4, group=32, key_axis="channel", **kw).update_and_fetch(k, v)
        UniformCache(bits=4, flush=1).update_and_fetch(k, v)


# batched and single-sequence caches hold the same values, copies laid out otherwise: equal
# to fp16 rounding (a BLAS may sum each product in another order)


def _filled(t: int, seed: int) -> UniformCache:
    c = UniformCache(bits=8, window=4)
    k, v = kv_data(t=t, seed=seed)
    c.update_and_fetch(k, v)
    return c


def test_merge_groups_rows_by_length_and_keeps_their_order():
    """merge (mlx-lm's batch protocol) keeps rows of other lengths in groups of their own,
    equal-length neighbours in one cache; filter, extend and extract keep each row's cache
    as it was, in the requested order; deepcopy is independent."""
    import copy

    from velox_core import VeloxBatch, routed

    a, b, c, d = _filled(40, 1), _filled(40, 2), _filled(25, 3), _filled(40, 4)
    batch = VeloxCache.merge([a, b, c, d])
    assert isinstance(batch, VeloxBatch) and batch.rows == [2, 1, 1]
    assert batch.offset.tolist() == [40, 40, 25, 40]
    assert batch.logical_nbytes == sum(x.logical_nbytes for x in (a, b, c, d))
    assert batch.nbytes <= sum(x.nbytes for x in (a, b, c, d))  # the copies hold no slack
    q = mx.random.normal((4, 4, 1, 128), key=mx.random.key(0)).astype(mx.float16)
    singles = [x.attend(q[i : i + 1], 0.1) for i, x in enumerate((a, b, c, d))]
    assert rel_error(batch.attend(q, 0.1), mx.concatenate(singles)) < 5e-4
    twin = copy.deepcopy(batch)
    batch.filter([3, 2, 0])
    assert batch.rows == [1, 1, 1] and batch.offset.tolist() == [40, 25, 40]
    got = batch.attend(q[mx.array([3, 2, 0])], 0.1)
    assert rel_error(got, mx.concatenate([singles[3], singles[2], singles[0]])) < 5e-4
    one = batch.extract(1)
    assert type(one) is UniformCache and one.offset == 25
    assert rel_error(one.attend(q[2:3], 0.1), singles[2]) < 5e-4
    batch.extend(twin)
    assert batch.batch_size == 7 and batch.offset.tolist() == [40, 25, 40, 40, 40, 25, 40]
    # a decode step writes each row's token into its own group; it needs routed attention
    k, v = kv_data(b=7, t=1, seed=9)
    with pytest.raises(ValueError, match="routed"):
        batch.update_and_fetch(k, v)
    with routed():
        batch.update_and_fetch(k, v)
    assert batch.offset.tolist() == [41, 26, 41, 41, 41, 26, 41]
    assert a.offset == 40 and twin.offset.tolist() == [40, 40, 25, 40]  # inputs untouched
    with pytest.raises(IndexError):
        batch.extract(7)


def test_prepare_takes_only_each_rows_real_tokens():
    """A right-padded prompt (lengths 5 and 3 in a padded input of 5): each row's cache
    stores its real tokens only, with RoPE offsets per row, and padding queries get zeros."""
    from velox_core import routed

    batch = VeloxCache.merge([UniformCache(bits=8), UniformCache(bits=8)])
    assert batch.rows == [2]
    batch.prepare(lengths=[5, 3], right_padding=[0, 2])
    assert batch.rows == [1, 1]
    k, v = kv_data(b=2, t=5, seed=5)
    q = mx.random.normal((2, 4, 5, 128), key=mx.random.key(1)).astype(mx.float16)
    with routed():
        batch.update_and_fetch(k, v)
        out = batch.attend(q, 0.1, mask="causal")
    batch.finalize()
    assert batch.offset.tolist() == [5, 3]
    assert mx.all(out[1, :, 3:] == 0).item()
    ref = UniformCache(bits=8)
    ref.update_and_fetch(k[1:, :, :3], v[1:, :, :3])
    assert rel_error(out[1:, :, :3], ref.attend(q[1:, :, :3], 0.1, mask="causal")) < 5e-4
    with pytest.raises(ValueError, match="right_padding needs lengths"):
        batch.prepare(right_padding=[1, 0])


def test_parts_name_each_groups_rows_and_stored_tokens():
    """parts(): each group with its batch rows and the token range of the newest update's
    padded input it stored (None where it stored the whole input)."""
    from velox_core import routed

    batch = VeloxCache.merge([UniformCache(bits=8), UniformCache(bits=8), UniformCache(bits=8)])
    k, v = kv_data(b=3, t=5, seed=5)
    batch.update_and_fetch(k, v)  # one group, no padding: the whole input
    assert [(r, s) for _, r, s in batch.parts()] == [((0, 3), None)]
    batch = VeloxCache.merge([UniformCache(bits=8), UniformCache(bits=8), UniformCache(bits=8)])
    batch.prepare(lengths=[5, 3, 3], right_padding=[0, 2, 2])
    with routed():
        batch.update_and_fetch(k[:, :, :4], v[:, :, :4])
        assert [(r, s) for _, r, s in batch.parts()] == [((0, 1), (0, 4)), ((1, 3), (0, 3))]
        batch.update_and_fetch(k[:, :, 4:], v[:, :, 4:])
        assert [(r, s) for _, r, s in batch.parts()] == [((0, 1), (0, 1)), ((1, 3), (0, 0))]
    assert [g for g, _, _ in batch.parts()] == batch.groups


def test_merge_keeps_rows_apart_whose_policies_decided_otherwise():
    """A policy's batch_key (a decision made per sequence) keeps caches of equal settings and
    layout in groups of their own where the keys differ, and in one where they agree."""
    from velox_core import RetentionPolicy
    from velox_core.registry import register

    @register
    class Decided(RetentionPolicy):
        name = "decided"

        key = None  # decided per sequence: state, not a setting

        def meta(self):
            return {**super().meta(), "key": self.key}

        def set_state(self, state, meta):
            super().set_state(state, meta)
            self.key = meta["key"]

        def batch_key(self):
            return self.key

    def filled(key):
        c = VeloxCache(policy=Decided(budget=64))
        c.policy.key = key
        k, v = kv_data(t=20, seed=1)
        c.update_and_fetch(k, v)
        return c

    assert VeloxCache.merge([filled(1), filled(1)]).rows == [2]
    assert VeloxCache.merge([filled(1), filled(2)]).rows == [1, 1]


def test_check_finite_refuses_nan_and_inf_before_storing_anything():
    """check_finite=True: a NaN or inf key or value is refused at update_and_fetch, naming the
    layer, the positions and the counts, and nothing of that update is stored (prefill chunks
    and decode steps alike); off by default (the check costs a sync), kept by fresh(), set by
    a spec parameter, and a non-bool is refused."""
    from velox_core import UniformCache as Uni
    from velox_core import make

    k = mx.random.normal((1, 2, 8, 64), key=mx.random.key(1)).astype(mx.float16)
    hole = (mx.arange(64) == 7)[None, None, None, :] & (mx.arange(8) == 5)[None, None, :, None]
    cache = Uni(bits=4, check_finite=True)
    cache.bind(None, 3)
    cache.update_and_fetch(k, k)
    with pytest.raises(
        ValueError,
        match=r"uniform \(layer 3\): non-finite input at positions 8 to 15: keys hold 2 NaN",
    ):
        cache.update_and_fetch(mx.where(hole, mx.array(float("nan"), mx.float16), k), k)
    one = k[:, :, :1]
    with pytest.raises(ValueError, match=r"positions 8 to 8: values hold 0 NaN and 128 inf of 128"):
        cache.update_and_fetch(one, mx.full(one.shape, float("inf"), mx.float16))
    assert cache.offset == cache.size() == 8
    cache.update_and_fetch(one, one)  # a finite step is stored as usual
    assert cache.offset == 9
    plain = Uni(bits=4)
    plain.update_and_fetch(mx.where(hole, mx.array(float("nan"), mx.float16), k), k)  # unchecked
    assert plain.offset == 8 and not plain.check_finite
    spec = make("uniform:bits=4,check_finite=true")
    assert spec.check_finite and spec.fresh().check_finite and "check_finite" in spec.config()
    assert "check_finite" not in plain.config()  # saved configs unchanged by the default
    with pytest.raises(TypeError, match="check_finite must be True or False"):
        Uni(bits=4, check_finite="yes")


@pytest.mark.parametrize("window,flush", [(16, 32), (0, 64)])
def test_decode_steps_flush_and_grow_ahead_of_their_write(window, flush, monkeypatch):
    """A decode step that fills the window to the flush quantum, or past its buffer, does
    that upkeep before writing its token and evaluates it on its own (``mx.async_eval`` of
    the stores), through the fast path: the general path's checks never run, and the stored
    tokens and attention equal a cache fed through the general path (``window=0``: the
    flush empties the window, which keeps its buffer's layout)."""
    import velox_core.cache.velox as vc

    k, v = kv_data(t=400)
    ref = UniformCache(bits=4, window=window, flush=flush)
    c = UniformCache(bits=4, window=window, flush=flush)
    for cache in (ref, c):
        cache.update_and_fetch(k[:, :, :300], v[:, :, :300])
        # the first step (an empty window has no buffer yet, with window=0)
        cache.update_and_fetch(k[:, :, 300:301], v[:, :, 300:301])
    monkeypatch.setattr(ref, "_write_window", lambda *_: False)  # the general path only
    for i in range(301, 400):
        ref.update_and_fetch(k[:, :, i : i + 1], v[:, :, i : i + 1])

    upkeep = []
    real = mx.async_eval
    monkeypatch.setattr(vc.mx, "async_eval", lambda *a: (upkeep.append(len(a[0])), real(*a)))

    def general(*_):
        raise AssertionError("a decode step took the general path")

    monkeypatch.setattr(vc, "check_kv", general)
    flushes = grows = 0
    for i in range(301, 400):
        tier, cap = c.stored.coded[0][0].tokens, c.stored.window[0].capacity
        c.update_and_fetch(k[:, :, i : i + 1], v[:, :, i : i + 1])
        flushes += c.stored.coded[0][0].tokens > tier
        grows += c.stored.window[0].capacity > cap
    assert flushes == 100 // flush and grows > 0 and len(upkeep) >= flushes + 1
    assert [s.tokens for s in c.segments()] == [s.tokens for s in ref.segments()]
    kk, vv = c.keys_and_values()
    rk, rv = ref.keys_and_values()
    assert mx.array_equal(kk, rk).item() and mx.array_equal(vv, rv).item()
    q = mx.random.normal((1, 4, 1, 128), key=mx.random.key(3)).astype(mx.float16)
    assert mx.array_equal(c.attend(q, 0.1), ref.attend(q, 0.1)).item()


class _Rotated(Uniform):
    """Uniform codes of ``R x``: a codec that stores rotated vectors (as TurboQuant does)."""

    def __init__(self, seed: int = 0, **kw):
        super().__init__(**kw)
        from velox_core.ops import RandomizedHadamard

        self.rot = RandomizedHadamard(128, seed)

    def stored_rotation(self):
        return self.rot

    def encode(self, x, positions=None):
        return super().encode(self.rot.forward(x).astype(x.dtype), positions)

    def decode(self, packed):
        return self.rot.inverse(super().decode(packed))

    def decode_as(self, packed, dtype):
        return self.decode(packed).astype(dtype)

    def decode_rotated_as(self, packed, dtype):
        return super().decode_as(packed, dtype)


@pytest.mark.parametrize("seeds", [(0, 0), (0, 1)])
def test_prefill_over_rotated_codes_equals_the_decoded_tokens(seeds, monkeypatch):
    """Tiers whose codecs share one rotation attend a prefill chunk in the rotated domain;
    tiers with two rotations decode to the model's coordinates. Either way the result is fused
    SDPA over the decoded tokens."""
    from velox_core.cache.attention import decode_segments

    k, v = kv_data(t=200)
    a, b = (_Rotated(seed=s, bits=8) for s in seeds)
    shared = seeds[0] == seeds[1]
    if shared:
        b.rot = a.rot
    c = VeloxCache(tiers=[Tier(a, a, span=64), Tier(b, b)], window=8, sinks=2)
    c.update_and_fetch(k, v)
    q = mx.random.normal((1, 4, 32, 128), key=mx.random.key(3)).astype(mx.float16)
    dk, dv = decode_segments(c.segments(), mx.float16)
    want = mx.fast.scaled_dot_product_attention(q, dk, dv, scale=0.1, mask="causal")
    rotated_back = []
    decode = _Rotated.decode
    monkeypatch.setattr(_Rotated, "decode", lambda s, p: rotated_back.append(1) or decode(s, p))
    got = c.attend(q, scale=0.1, mask="causal")
    assert bool(rotated_back) != shared  # shared: no stored token rotated back
    assert rel_error(got, want) < 5e-3
    with pytest.raises(TypeError, match="rotation"):
        Uniform(bits=4).decode_rotated_as(c.segments()[1].keys, mx.float16)


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
@pytest.mark.parametrize("dtype", [mx.float16, mx.bfloat16, mx.float32])
def test_channel_codes_decode_in_the_model_dtype(bits, dtype):
    """Per-channel codes (KIVI's keys) decode for a prefill straight in the model's dtype:
    the float32 decode rounded to it (within a rounding of the product and of the sum)."""
    k, _ = kv_data(t=96, dtype=mx.float16)
    codec = Uniform(bits=bits, group=32, axis="channel")
    packed = codec.encode(k)
    want = codec.decode(packed)
    got = codec.decode_as(packed, dtype)
    assert got.dtype == dtype and got.shape == want.shape
    eps = {mx.float16: 2.0**-11, mx.bfloat16: 2.0**-8, mx.float32: 2.0**-23}[dtype]
    bound = 3 * eps * (mx.abs(want) + mx.abs(packed.data["zero"]).max()) + 1e-6
    assert bool(mx.all(mx.abs(got.astype(mx.float32) - want) <= bound))


def test_stored_is_the_segments_view_in_temporal_order():
    # sinks | tier 0 | window: the counts, dims and store names the view reports are what the
    # cache holds, and its window arrays are the newest tokens as given
    cache = VeloxCache(Uniform(bits=4, group=32), Uniform(bits=4, group=32), sinks=4, window=8)
    k, v = kv_data(t=100, seed=1)
    cache.update_and_fetch(k, v)
    st = cache.stored
    assert (st.n_sink, st.coded[0][0].tokens, st.n_window) == (4, 88, 8)
    assert st.n_sink + st.coded[0][0].tokens + st.n_window == cache.size() == 100
    assert st.dims == (k.shape[0], k.shape[1], k.shape[3], v.shape[3]) and st.batch == k.shape[0]
    wk, wv = (w.view().data["x"] for w in st.window)
    assert mx.array_equal(wk, k[:, :, -8:]).item() and mx.array_equal(wv, v[:, :, -8:]).item()
    assert sorted(cache.named_stores()) == [
        "sink.k",
        "sink.v",
        "tier0.k",
        "tier0.v",
        "win.k",
        "win.v",
    ]
    kb, vb, pb = st.body()
    assert kb.tokens == vb.tokens == 88 and pb is None
