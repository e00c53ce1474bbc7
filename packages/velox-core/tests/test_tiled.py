"""Prefill attention over slices of the stored tokens
(velox_core.cache.attention.tiled_prefill_attention): slices of every codec that declares
``decodes_slices`` decode exactly; the tiled path gives the fused path's output (sinks,
windows, tiers, block codecs, masks, sink logits, GQA); the automatic choice; and its
transient memory."""

from __future__ import annotations

import math

import mlx.core as mx
import pytest

from velox_core import Identity, Tier, Uniform, VeloxCache
from velox_core.cache import attention as tiled
from velox_core.cache.attention import attend
from velox_testing import kv_data

SLICING = {
    "identity": Identity,
    "uniform-4-token": lambda: Uniform(4),
    "uniform-3-token-32": lambda: Uniform(3, 32),
    "uniform-2-channel-32": lambda: Uniform(2, 32, axis="channel"),  # KIVI's keys
    "uniform-8-channel-16": lambda: Uniform(8, 16, axis="channel"),
}


@pytest.mark.parametrize("name", sorted(SLICING))
def test_a_block_aligned_slice_decodes_to_the_whole_record_s_tokens(name):
    """What ``decodes_slices`` declares: every block-aligned slice of a record decodes to
    exactly those tokens of the whole record's decode (decode and decode_as)."""
    codec = SLICING[name]()
    assert codec.decodes_slices
    k, _ = kv_data(t=192)
    packed = codec.encode(k)
    whole = codec.decode(packed)
    whole16 = codec.decode_as(packed, mx.float16)
    b = packed.block
    for a, z in ((0, 64), (64, 96), (96, 192), (32, 160), (0, 192)):
        a, z = a // b * b, z // b * b
        part = packed.slice(a, z)
        assert mx.array_equal(codec.decode(part), whole[:, :, a:z]), (a, z)
        assert mx.array_equal(codec.decode_as(part, mx.float16), whole16[:, :, a:z]), (a, z)


def _caches():
    """Caches whose segments cover the cases: fp16 only, coded body with sinks and window,
    per-channel (block) keys with tokens waiting for a block, two tiers."""
    return {
        "identity": VeloxCache(window=16, sinks=4),
        "uniform-sinks-window": VeloxCache(Uniform(4), Uniform(4), window=32, sinks=4),
        "kivi-blocks": VeloxCache(
            Uniform(2, 32, axis="channel"), Uniform(2, 32), window=8, flush=32
        ),
        "tiers": VeloxCache(
            tiers=[
                Tier(Uniform(8), Uniform(8), span=96),
                Tier(Uniform(4, 32, axis="channel"), Uniform(3, 32)),
            ],
            sinks=2,
        ),
    }


def _filled(cache, t=300):
    k, v = kv_data(t=t)
    k, v = k.astype(mx.float32), v.astype(mx.float32)
    for a, z in ((0, 100), (100, 101), (101, 251), (251, t)):
        cache.update_and_fetch(k[:, :, a:z], v[:, :, a:z])
    return cache


def _masks(lq: int, t: int):
    key = mx.random.key(7)
    keep = mx.random.uniform(shape=(1, 4, lq, t), key=key) > 0.3
    keep = keep | (mx.arange(t)[None] == mx.arange(t - lq, t)[:, None])  # a visible column
    additive = mx.where(keep, 0.0, -1e9)[:, :1] + mx.random.normal((1, 1, lq, t), key=key)
    return {"none": None, "causal": "causal", "bool-per-head": keep, "additive": additive}


@pytest.mark.parametrize("cache_name", sorted(_caches()))
def test_tiled_prefill_equals_the_fused_path(cache_name):
    """float32 keys and values: the tiled path (slices of 24 tokens, rounded to blocks)
    gives the fused path's output within float32 rounding, for every mask kind, with and
    without sink logits, 4 query heads over 2 KV heads."""
    cache = _filled(_caches()[cache_name])
    segs = cache.segments()
    t = sum(s.tokens for s in segs)
    assert len(segs) >= 2 and tiled.can_tile(segs)
    lq = 40
    q = mx.random.normal((1, 4, lq, 128), key=mx.random.key(1))
    scale = 1 / math.sqrt(128)
    for sinks in (None, mx.array([0.5, -1.0, 2.0, 0.0])):
        for name, mask in _masks(lq, t).items():
            ref = attend(q, segs, scale, mask, sinks, fused_above=16, tile=0)
            got = attend(q, segs, scale, mask, sinks, fused_above=16, tile=24)
            assert mx.allclose(got, ref, atol=2e-5, rtol=1e-4), (name, sinks is not None)
    # the cache's own attend, its prefill_tile set
    cache.prefill_tile = 24
    got = cache.attend(q, scale, "causal")
    cache.prefill_tile = 0
    assert mx.allclose(got, cache.attend(q, scale, "causal"), atol=2e-5, rtol=1e-4)


def test_tiled_fp16_is_as_close_to_exact_attention_as_the_fused_path():
    """fp16 keys and values: the tiled path (float32 inside) is no further from attention
    computed in float32 on the same decoded tokens than the fused fp16 path is."""
    cache = VeloxCache(Uniform(4), Uniform(4), window=32, sinks=4)
    k, v = kv_data(t=600)
    cache.update_and_fetch(k, v)
    segs = cache.segments()
    q = mx.random.normal((1, 4, 64, 128), key=mx.random.key(2)).astype(mx.float16)
    kk, vv = (x.astype(mx.float32) for x in cache.keys_and_values())
    scale = 1 / math.sqrt(128)
    exact = mx.fast.scaled_dot_product_attention(
        q.astype(mx.float32), kk, vv, scale=scale, mask="causal"
    )
    fused = attend(q, segs, scale, "causal", tile=0).astype(mx.float32)
    sliced = attend(q, segs, scale, "causal", tile=128).astype(mx.float32)
    assert (
        sliced.dtype == mx.float32 and attend(q, segs, scale, "causal", tile=128).dtype == q.dtype
    )
    err_fused = mx.abs(fused - exact).max().item()
    err_tiled = mx.abs(sliced - exact).max().item()
    assert err_tiled <= err_fused + 1e-3, (err_tiled, err_fused)


class _WholeRecord(Uniform):
    """A Uniform whose decode (for this test) is declared not to slice."""

    decodes_slices = False


def test_automatic_choice_and_codecs_that_do_not_slice(monkeypatch):
    assert mx.default_device() == mx.cpu
    tile = tiled.TILE
    # a long chunk (2048 queries of 4 heads, fp16): the fused path holds fewer bytes over
    # 1024 stored tokens (16.5 MiB against the slices' 26 MiB), more over 2048 (33 MiB)
    chunk = {"query_shape": (1, 4, 2048, 64), "kv_heads": 2, "itemsize": 2}
    assert tiled.prefill_tile(None, 1024, **chunk) == 0
    assert tiled.prefill_tile(None, 2048, **chunk) == tile
    # a short chunk in float32 (64 queries of one head): the decoded tokens decide
    short = {"query_shape": (1, 1, 64, 128), "kv_heads": 1, "itemsize": 4}
    assert tiled.prefill_tile(None, 400, **short) == 0
    assert tiled.prefill_tile(None, 600, **short) == tile
    assert tiled.prefill_tile(None, tile, **short) == 0  # one slice: nothing to slice
    assert tiled.prefill_tile(0, 10_000, **chunk) == 0
    assert tiled.prefill_tile(64, 1000) == 64 and tiled.prefill_tile(64, 64) == 0
    with pytest.raises(ValueError, match="prefill_tile"):
        tiled.prefill_tile(-1, 1000)
    with monkeypatch.context() as m:  # a GPU: never by default
        m.setattr(tiled.mx, "default_device", lambda: mx.gpu)
        assert tiled.prefill_tile(None, 100_000, **chunk) == 0
        assert tiled.prefill_tile(256, 100_000) == 256
    calls = []
    real = tiled.tiled_prefill_attention
    monkeypatch.setattr(
        tiled, "tiled_prefill_attention", lambda *a, **k: calls.append(1) or real(*a, **k)
    )
    q = mx.random.normal((1, 4, 32, 128), key=mx.random.key(3)).astype(mx.float16)
    k, v = kv_data(t=1200)
    for codec, expected in ((Uniform, 1), (_WholeRecord, 0)):
        cache = VeloxCache(codec(4), codec(4))
        cache.update_and_fetch(k, v)
        calls.clear()
        cache.attend(q, 0.1, "causal")
        assert len(calls) == expected, codec.__name__
    with pytest.raises(ValueError, match="does not decode slices"):
        real(q, cache.segments(), 0.1)


def _transient(fn) -> float:
    mx.synchronize()
    mx.clear_cache()
    base = mx.get_active_memory()
    mx.reset_peak_memory()
    mx.eval(fn())
    return mx.get_peak_memory() - base


def test_tiled_transient_is_a_fraction_of_the_fused_path_s():
    """256 queries over 4096 stored tokens (4 query heads): the fused path holds the chunk x
    context scores, the tiled path one slice's."""
    cache = VeloxCache(Uniform(4), Uniform(4))
    k, v = kv_data(t=4096, h=2, d=64)
    cache.update_and_fetch(k, v)
    segs = cache.segments()
    mx.eval([s.keys.arrays() + s.values.arrays() for s in segs])
    q = mx.random.normal((1, 4, 256, 64), key=mx.random.key(4)).astype(mx.float16)
    mx.eval(q)
    fused = _transient(lambda: attend(q, segs, 0.125, "causal", tile=0))
    sliced = _transient(lambda: attend(q, segs, 0.125, "causal", tile=256))
    assert sliced < 0.5 * fused, (sliced, fused)


def test_packed_tiles_are_whole_blocks_covering_every_token_in_order():
    from velox_core.codec.base import Packed

    data = {"codes": mx.arange(2 * 10 * 3).reshape(1, 2, 10, 3), "mean": mx.zeros((1, 2, 5, 3))}
    p = Packed(data, 10, 2, frozenset({"mean"}))
    spans = [(a, z, t.tokens) for a, z, t in p.tiles(5)]  # 5 tokens round down to 2 blocks
    assert spans == [(0, 4, 4), (4, 8, 4), (8, 10, 2)]
    assert all(mx.array_equal(t.data["codes"], data["codes"][:, :, a:z]) for a, z, t in p.tiles(5))
    assert [z for _, z, _ in p.tiles(1)] == [2, 4, 6, 8, 10]  # one block at least
    assert p.tiles(64) == [(0, 10, p)]
