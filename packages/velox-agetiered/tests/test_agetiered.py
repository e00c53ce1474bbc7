"""AgeTiered: the conformance suite, and what is the method's own."""

import itertools
import math

import mlx.core as mx
import pytest
from mlx_lm.models.cache import QuantizedKVCache

from velox_agetiered import METHOD, AgeTieredCache
from velox_core import Codec, Tier, Uniform, get_method, make
from velox_testing import CacheConformance, assert_head_dim_refused, feed, kv_data, rel_error

FOUR, THREE, TWO = METHOD.recommended


class TestAgeTiered(CacheConformance):
    """The default (4-bit) setting; at <= 512 tokens only its 8- and 6-bit tiers are used."""

    max_memory_ratio = 0.35  # 2,048 tokens: 64 at 8 bits, 1,216 at 6, 768 at 3: 0.34
    attention_error = 0.06  # measured 0.037 (8- and 6-bit tiers only at 512 tokens)
    same_greedy_tokens = 32

    bad_settings = (
        ({"recent_bits": 9}, "recent_bits"),
        ({"old_bits": 1}, "old_bits"),
        ({"middle_bits": 8, "recent_bits": 6}, "middle_bits"),
        ({"old_bits": 4, "middle_bits": 3}, "old_bits"),
        ({"recent": 0}, "recent"),
        ({"middle": -64}, "middle"),
        ({"recent": 100}, "recent"),  # not a multiple of the key group (64)
        ({"middle": 96}, "middle"),
        ({"value_axis": "channel", "key_axis": "token", "recent": 48}, "recent"),
        ({"recent": 64.0}, "recent"),
        ({"recent_bits": 4.5}, "recent_bits"),
        ({"key_axis": "head"}, "key_axis"),
        ({"value_axis": None}, "value_axis"),
        ({"sinks": -2}, "sinks"),
        ({"budget": 512}, "budget"),
    )

    def make(self):
        return AgeTieredCache()

    def make_precise(self):
        # small groups and spans so that 80 tokens cross both boundaries
        return AgeTieredCache(
            recent_bits=8, middle_bits=7, old_bits=6, recent=16, middle=16, group=16
        )


class TestAgeTieredShort(CacheConformance):
    """Short spans, sinks and a window: every boundary is crossed within the suite's inputs."""

    max_memory_ratio = 0.3  # measured 0.295
    attention_error = 0.35  # measured 0.26: most of 512 tokens at 3 bits (flat 3-bit: 0.33)
    same_greedy_tokens = 32

    def make(self):
        return AgeTieredCache(recent=32, middle=96, group=32, sinks=4, window=8)

    def make_precise(self):
        return AgeTieredCache(
            recent_bits=8, middle_bits=7, old_bits=6, recent=16, middle=16, group=16, sinks=4
        )


class Counting(Codec):
    """Wraps a codec and records the positions of every token it encodes."""

    name = "counting"

    def __init__(self, inner: Codec):
        self.inner, self.block, self.seen = inner, inner.block, []

    def config(self):
        return self.inner.config()

    def check(self, dim, dtype):
        self.inner.check(dim, dtype)

    def encode(self, x, positions=None):
        self.seen.extend(positions.tolist())
        return self.inner.encode(x, positions)

    def decode(self, packed):
        return self.inner.decode(packed)


def _tier_sizes(cache):
    """Tokens per segment, newest tier first: (sinks, [tier0, tier1, ...], window)."""
    return (
        cache.stored.sink[0].tokens,
        [ks.tokens for ks, _ in cache.stored.coded],
        cache.stored.window[0].tokens,
    )


# -- construction ---------------------------------------------------------------------------
def test_tiers_follow_the_settings():
    c = AgeTieredCache(recent_bits=8, middle_bits=4, old_bits=2, recent=128, middle=256)
    assert [t.span for t in c.tiers] == [128, 256, None]
    for t, bits in zip(c.tiers, (8, 4, 2)):
        assert isinstance(t.key_codec, Uniform) and isinstance(t.value_codec, Uniform)
        assert t.key_codec.bits == t.value_codec.bits == bits
        assert (t.key_codec.axis, t.value_codec.axis) == ("channel", "token")
        assert t.key_codec.group == t.value_codec.group == 64
    tok = AgeTieredCache(key_axis="token", recent=10, middle=3, group=32)
    assert tok.tiers[0].key_codec.axis == "token" and tok.tiers[0].key_codec.block == 1


@pytest.mark.parametrize(
    ("bits", "spans"),
    [((6, 6, 3), [192, None]), ((8, 3, 3), [64, None]), ((4, 4, 4), [None])],
)
def test_equal_widths_are_one_tier(bits, spans):
    c = AgeTieredCache(recent_bits=bits[0], middle_bits=bits[1], old_bits=bits[2], middle=128)
    assert [t.span for t in c.tiers] == spans


def test_registry_and_shared_names():
    assert get_method("agetiered") is METHOD
    c = make("agetiered:recent_bits=8,middle_bits=4,old_bits=2,recent=64,middle=128,sinks=4")
    assert isinstance(c, AgeTieredCache) and c.sinks == 4
    assert c.fresh().config() == c.config()
    with pytest.raises(ValueError, match="recent_bits"):
        AgeTieredCache(bits=4)  # tiers set the widths: the shared `bits` is not accepted


def test_per_token_groups_must_divide_the_head_dim():
    k, v = kv_data(t=8, d=96)
    c = AgeTieredCache(key_axis="token", recent=8, middle=8, group=64)
    with pytest.raises(ValueError, match="group"):
        c.update_and_fetch(k, v)


# -- the tiers ---------------------------------------------------------------------------
@pytest.mark.parametrize("chunks", [(700,), (1,), (100, 1, 60, 1, 1), (33, 257)])
def test_layout_is_exact_for_any_chunking(chunks):
    k, v = kv_data(t=700, d=64)
    cfg = dict(recent=64, middle=128, group=32, sinks=3, window=5)
    c = AgeTieredCache(**cfg)
    feed(c, k, v, chunks)
    n = c.cfg.layout(700)
    assert _tier_sizes(c) == (n["sinks"], [n["recent"], n["middle"], n["old"]], n["window"])
    assert (n["recent"], n["middle"]) == (64, 128) and 5 <= n["window"] < 5 + 32


def test_error_grows_with_age():
    k, v = kv_data(t=1024)
    c = AgeTieredCache(recent=64, middle=256, window=16)
    c.update_and_fetch(k, v)
    old, middle, recent, win = c.segments()
    errs = []
    start = 0
    for seg in (old, middle, recent, win):
        kk = seg.key_codec.decode(seg.keys)
        vv = seg.value_codec.decode(seg.values)
        ref_k, ref_v = k[:, :, start : start + seg.tokens], v[:, :, start : start + seg.tokens]
        errs.append((rel_error(kk, ref_k), rel_error(vv, ref_v)))
        start += seg.tokens
    assert start == 1024
    for e_older, e_newer in itertools.pairwise(errs):
        assert e_older[0] > 2 * e_newer[0] and e_older[1] > 2 * e_newer[1], errs
    assert errs[-1] == (0.0, 0.0)  # the window is kept as given


def test_each_token_is_coded_once_per_tier():
    k, v = kv_data(t=700, d=64)
    c = AgeTieredCache(recent=64, middle=128, group=32, sinks=3, window=5)
    c.tiers = [Tier(Counting(t.key_codec), Counting(t.value_codec), t.span) for t in c.tiers]
    feed(c, k, v, (100, 1, 60, 1, 1, 7))
    sinks, (n0, n1, n2), win = _tier_sizes(c)
    assert n2 > 0 and win < 5 + 32
    # tier 0 coded every token that left the window, tier 1 those older than tier 0, ...
    for i, upto in enumerate((n2 + n1 + n0, n2 + n1, n2)):
        for codec in (c.tiers[i].key_codec, c.tiers[i].value_codec):
            assert sorted(codec.seen) == list(range(sinks, sinks + upto)), i


@pytest.mark.parametrize(
    "cfg",
    [
        {"recent": 64, "middle": 128, "group": 32, "sinks": 3, "window": 5},
        {
            "recent_bits": 8,
            "middle_bits": 4,
            "old_bits": 3,
            "recent": 32,
            "middle": 96,
            "group": 32,
        },
        {"key_axis": "token", "recent": 50, "middle": 77, "group": 32, "window": 3},
    ],
)
def test_same_codes_for_any_chunking(cfg):
    k, v = kv_data(t=600, d=64)
    states = []
    for chunks in ((600,), (1,), (100, 1, 60, 1, 1), (2, 333, 17)):
        meta, arrays = feed(AgeTieredCache(**cfg), k, v, chunks)._state_dict()
        states.append((meta["stores"], arrays))
    stores, arrays = states[0]
    assert sum(s["tokens"] for s in stores.values()) == 2 * 600
    for other_stores, other in states[1:]:
        assert other_stores == stores and sorted(other) == sorted(arrays)
        assert all(mx.array_equal(other[name], arrays[name]) for name in arrays)


def test_bytes_per_token_fall_with_age():
    """Measured bytes per token equal the Packed layout of docs/agetiered.md, and fall."""
    b, h, d, g = 1, 2, 128, 64
    k, v = kv_data(b=b, h=h, t=1024, d=d)
    c = AgeTieredCache(recent=64, middle=256, window=16)
    c.update_and_fetch(k, v)
    per_token = []
    for seg, bits in zip(c.segments(), (3, 6, 8, 16)):
        got = (seg.keys.nbytes + seg.values.nbytes) / (seg.tokens * b * h)
        layout = 2 * d * 2 if bits == 16 else 2 * (math.ceil(d * bits / 32) * 4 + 4 * d / g)
        assert got == layout, (bits, got, layout)
        per_token.append(got)
    assert per_token == sorted(per_token) and len(set(per_token)) == 4


def test_nested_widths_recode_without_loss():
    """8 -> 6 -> 3 ends as good as direct 3-bit codes; 4 -> 3 stretches keys (docs)."""
    k, v = kv_data(t=1024)
    direct = Uniform(3, 64, "channel")
    e_direct = rel_error(direct.decode(direct.encode(k)), k)

    def old_tier_error(bits):
        c = AgeTieredCache(recent_bits=8, middle_bits=bits, old_bits=3, recent=64, middle=64)
        c.update_and_fetch(k, v)
        old = c.segments()[0]
        return rel_error(old.key_codec.decode(old.keys), k[:, :, : old.tokens])

    assert old_tier_error(6) < 1.01 * e_direct
    assert old_tier_error(4) > 1.04 * e_direct


# -- the recommended settings -------------------------------------------------------------
def test_recommended_average_bits_at_4k():
    bits = [AgeTieredCache(**s).cfg.average_bits(4096) for s in (FOUR, THREE, TWO)]
    assert 3.9 <= bits[0] <= 4.0 and 2.9 <= bits[1] <= 3.2 and 2.0 <= bits[2] <= 2.25, bits
    for s in METHOD.recommended:  # nested widths only: every step re-codes without loss
        widths = (s["recent_bits"], s["middle_bits"], s["old_bits"])
        assert all(a == 8 or a % b == 0 for a, b in itertools.pairwise(widths)), s


def _mlx_q4(x):
    w, s, z = mx.quantize(x, group_size=64, bits=4)
    return mx.dequantize(w, s, z, group_size=64, bits=4)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_four_bit_setting_beats_mlx_q4_at_4k(seed):
    """No more bytes than mlx-lm's QuantizedKVCache(64, 4) fed the same 4,096 tokens, and
    no more attention error than mlx's own 4-bit group-64 codes on kv_data."""
    t, d = 4096, 128
    k, v = kv_data(t=t, d=d, seed=seed)
    for chunks in ((t,), (512,)):
        ours = feed(AgeTieredCache(**FOUR), k, v, chunks)
        theirs = feed(QuantizedKVCache(group_size=64, bits=4), k, v, chunks)
        mx.eval(theirs.state, *[a for a in ours.state if isinstance(a, mx.array)])
        assert ours.nbytes <= theirs.nbytes, (chunks, ours.nbytes, theirs.nbytes)
    keys = [mx.random.key(s) for s in range(10, 26)]
    q = mx.concatenate([mx.random.normal((1, 4, 1, d), key=s) for s in keys], axis=2)
    q = (q + k[:, :1, -1:] / 4).astype(mx.float16)
    scale = 1 / math.sqrt(d)
    ref = mx.fast.scaled_dot_product_attention(q, k, v, scale=scale)
    mlx = mx.fast.scaled_dot_product_attention(q, _mlx_q4(k), _mlx_q4(v), scale=scale)
    err = rel_error(ours.attend(q, scale=scale), ref)
    assert err <= rel_error(mlx, ref), (err, rel_error(mlx, ref))


def test_make_cache_refuses_a_head_dim_naming_agetiered_and_its_parameter():
    assert_head_dim_refused(
        "agetiered", "group=64 must divide the value head dim 80", "agetiered:group=16"
    )
