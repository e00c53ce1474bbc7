"""CommVQ's kernel path, checked on a machine without a GPU.

The decode kernel is velox-core's portable one with this package's table keys
(:mod:`velox_commvq.layout`: ``TableCodes`` and the key pass it ships); here the CommVQ glue
and layout are checked: which records take it
and what the kernel declines, and, with the kernels' Metal and CUDA instantiations emulated
on the CPU (``velox_testing.emulate``), that attention through the kernel (query tables
built once per call, each key's looked-up sums rotated by its angle in the kernel, values
mixed in the same pass) equals the codec's reference code-domain path
(:func:`velox_commvq.scores.code_scores`): 1- and 2-bit keys, both RoPE layouts, partial
rotary dims and a scaled RoPE, positions from 0 to past 100,000, batch rows at their own
offsets, and a cache's fp16 window and sinks joined in one softmax over decode steps.
"""

from __future__ import annotations

import dataclasses
import math

import mlx.core as mx
import numpy as np
import pytest
from _commvq_util import BASE, synthetic

import velox_core.kernels as vk
from velox_commvq import CommVQCache, CommVQKeys
from velox_commvq.kernels import kernel_tables, table_codes
from velox_commvq.layout import TABLE, TableCodes, TableKeys, TableLayout, table_entries
from velox_core import Packed, Uniform
from velox_core.cache import attention as att
from velox_core.cache.attention import Segment, fused_partial, joint_attention, partial
from velox_core.kernels import config as kcfg
from velox_core.kernels import decode as dk
from velox_core.kernels import portable as kport
from velox_core.kernels.build import ArgInfo, KernelSpec
from velox_testing import (
    assert_cpu_declines,
    assert_partials_close,
    kernel_env,
)
from velox_testing.emulate import DecodeRun, EmulatedKernels, Emulator, compiler, emulated_or_skip
from velox_testing.kernel_path import INSTANTIATIONS, compile_instantiation

needs_gxx = pytest.mark.skipif(
    compiler() is None, reason="no C++ compiler (g++ or $CXX): the kernels cannot be emulated"
)

# the default geometry (G = 4 pairs a code, K = 16: 1 bit a coordinate a stage)
DEFAULT = {"pairs": 4, "entries": 16, "stages": 2}
# RoPE settings (codec keywords) and the artifact layout they need
LAYOUTS = {
    "default": ({}, (128, 0)),
    "traditional": ({"rope_traditional": True}, (128, 1)),
    "partial": ({"rope_dims": 64, "rope_traditional": True}, (64, 1)),
    "scaled": ({"rope_scale": 0.25}, (128, 0)),  # mlx.nn.RoPE(scale=0.25): theta * 0.25
}
# positions of a record's tokens: from 0, at an offset, and far out (angles past 1e5 rad)
POSITIONS = {"start": 0, "offset": 1000, "far": 123_000}


def codec(layout="default", bits=2, geometry=None, name=None):
    rope, lay = LAYOUTS[layout]
    geo = geometry or DEFAULT
    tag = name or f"k-{layout}-{'-'.join(str(v) for v in geo.values())}"
    path = synthetic(tag, layout=lay, **geo)
    return CommVQKeys(bits=bits, codebooks=path, layer=0, rope_base=BASE, **rope)


def records(c, t=200, starts=(0,), seed=0, value_bits=4):
    """Keys coded at positions ``start .. start + t`` for each batch row (rows joined on the
    batch axis, each with its own positions), and per-token Uniform values."""
    parts = []
    for i, start in enumerate(starts):
        k = mx.random.normal((1, 2, t, 128), key=mx.random.key(seed + i))
        parts.append(c.encode(k, mx.arange(start, start + t).astype(mx.int32)))
    kp = Packed({n: mx.concatenate([p.data[n] for p in parts]) for n in parts[0].data}, t)
    v = mx.random.normal((len(starts), 2, t, 128), key=mx.random.key(seed + 99))
    vc = Uniform(value_bits, 64)
    return kp, vc, vc.encode(v)


def queries(b, m, seed=3):
    return mx.random.normal((b, 2, m, 128), key=mx.random.key(seed)) * 0.2


def kernel_sides(c, kp, vc, vp, q_shape=(1, 2, 2, 128)):
    """The records of the segment's kernel sides, or None (the reference path)."""
    sides = att.kernel_sides(c, kp, vc, vp, q_shape)
    return None if sides is None else (sides[0].record, sides[1].record)


def attend_partial(c, q, kp, vc, vp):
    return fused_partial(q, Segment(c, kp, vc, vp))


def test_the_table_code_path_is_on_by_default_and_can_be_turned_off(monkeypatch):
    kernel_env(monkeypatch, "VELOX_LAYOUTS_OFF", None)
    assert kcfg.kernel_config().layouts_off == frozenset()
    c = codec(bits=2)
    kp, vc, vp = records(c, t=16)
    monkeypatch.setattr(vk, "backend", lambda: "cuda")  # a GPU as far as dispatch can tell
    keys, values = kernel_sides(c, kp, vc, vp)
    monkeypatch.setattr(dk, "plan_portable", lambda *a: "planned")
    assert dk.plan_decode((1, 2, 2, 128), mx.float32, keys, values, q_sketch=True) is not None
    kernel_env(monkeypatch, "VELOX_LAYOUTS_OFF", "vq, table")
    assert kcfg.kernel_config().layouts_off == {"vq", "table"}
    assert dk.plan_decode((1, 2, 2, 128), mx.float32, keys, values, q_sketch=True) is None


@pytest.fixture
def emulated_gpu(monkeypatch, tmp_path):
    """The library's kernel launches sent to the emulated Metal instantiation."""
    return emulated_or_skip(monkeypatch, tmp_path)


# -- the layout: records, registration, the key pass this package ships ---------------------------

U32 = mx.zeros((1, 1, 4, 16), mx.uint32)
F16 = mx.zeros((1, 1, 4), mx.float16)
TK = TableKeys(stages=2, theta=mx.zeros((64,), mx.float32))


def test_table_records_are_checked_when_built():
    rec = TableCodes(bits=4, group=4, codes=U32, norm=F16, positions=U32, table=TK)
    assert (rec.a, rec.b, rec.table, rec.levels, rec.signs) == (F16, U32, TK, None, None)
    for bits in (0, 9, 3.0, None):
        with pytest.raises(ValueError, match="TableCodes: bits must be an int from 1 to 8"):
            TableCodes(bits=bits, group=4, codes=U32, norm=F16, positions=U32, table=TK)
    with pytest.raises(ValueError, match="table must be a TableKeys record"):
        TableCodes(bits=4, group=4, codes=U32, norm=F16, positions=U32, table=None)
    with pytest.raises(ValueError, match="TableCodes: positions is required"):
        TableCodes(bits=4, group=4, codes=U32, norm=F16, positions=None, table=TK)


def test_the_table_layout_is_registered_with_its_key_pass():
    from velox_core.kernels import layout as lay

    rec = TableCodes(bits=4, group=4, codes=U32, norm=F16, positions=U32, table=TK)
    got = lay.layout_of(rec)
    assert type(got) is TableLayout and lay.layout_for(TABLE) is got and got.keys_only
    spec = kport.decode_spec(rec)
    assert spec.name == "velox_decode_attention_table" and spec is kport.decode_spec(rec)
    assert spec.inserts == ((kport.KEY_PASS, "decode_table_keys.metal", "velox_commvq"),)
    body = spec.body("metal")
    assert "KSTG" in body and "KSTG" not in kport.DECODE.body("metal")
    assert kport.decode_spec(vals_record()) is kport.DECODE
    assert kport.side_ok(TABLE, 4, 4, 128, 16) and not kport.side_ok(TABLE, 4, 3, 128, 16)


def vals_record():
    return Uniform(4, 64).kernel_codes(Uniform(4, 64).encode(mx.zeros((1, 1, 4, 128))))


# the default geometry (2 stages of 4-bit indices per 4 pairs) at 2 and 8 query rows (a
# lane's indices whole words / a share of one), 3-bit indices straddling words
COMPILED = ((4, 4, 2), (4, 4, 8), (3, 1, 2))


def _variants():
    f32, u32, h16, dummy = (
        ("float32", 4, 1 << 20),
        ("uint32", 4, 1 << 20),
        ("float16", 4, 1 << 20),
        ("float32", 1, 8),
    )
    vside = vals_record()
    out = []
    for kb, kg, m_rows in COMPILED:
        kside = TableCodes(bits=kb, group=kg, codes=U32, norm=F16, positions=U32, table=TK)
        p = kport.plan_for(m_rows, 128, kside, vside)
        ins = [u32, ("float16", 3, 1 << 20), ("int32", 3, 1 << 20), ("float32", 1, 64)]
        infos = [ArgInfo(*a) for a in [f32, *ins, u32, h16, h16, dummy]]
        infos += [ArgInfo(*a) for a in (dummy, dummy, f32, dummy, dummy)]
        tmpl = kport.template(p, 128, kside, vside)
        assert dict(tmpl)["KOWN"] == 1 and dict(tmpl)["KOLV"] == 64 and dict(tmpl)["KSTG"] == 2
        out.append((kport.decode_spec(kside), infos, ["float32"] * 2, tmpl))
    return out


@pytest.mark.parametrize("backend", INSTANTIATIONS)
def test_the_key_pass_compiles_in_each_instantiation(tmp_path, backend):
    """The portable kernel with this package's key pass in place, through the C++ shim of
    Metal (as velox-core's tests compile its own variants) and through nvcc for sm_90a,
    without register spills."""
    compile_instantiation(backend, _variants(), tmp_path)


# -- which records take the kernel ---------------------------------------------------------------


def test_attend_partial_is_none_on_the_cpu():
    c = codec()
    assert_cpu_declines(c, *records(c, t=16), q_shape=(1, 2, 2, 128))


def test_kernel_record_is_the_stored_codes(monkeypatch):
    c = codec(bits=2)
    kp, vc, vp = records(c, t=16, starts=(5, 70))
    keys = table_codes(c, kp)
    assert type(keys) is TableCodes and keys.kind == TABLE
    assert (keys.bits, keys.group) == (4, 4)
    assert keys.codes is kp.data["codes"] and keys.norm is kp.data["norm"] is keys.a
    assert keys.positions is kp.data["pos"] is keys.b and keys.table.stages == 2
    first, second, theta = c.rope.pairs(128)
    assert np.array_equal(np.asarray(keys.table.theta), theta)
    assert c.pair_theta() is keys.table.theta  # made once
    # one row of tables per query: S * P * 2 books * K entries * (re, im)
    tab = kernel_tables(c, queries(2, 3))
    assert tab.shape == (2, 2, 3, table_entries(2, 128, 4)) == (2, 2, 3, 2 * 64 * 2 * 16 * 2)
    # entry (((s * P + p) * 2 + book) * K + k) * 2 + c is conj(q_p) A[s, p, k] (book 0)
    q = queries(2, 3)
    a, _ = c.codewords()
    qp = np.asarray(q)[1, 0, 2]  # batch 1, head 0, row 2
    s, p, k = 1, 37, 11
    z = complex(qp[first[p]], -qp[second[p]]) * complex(*np.asarray(a[0, s, p, k], np.float32))
    e = (((s * 64 + p) * 2 + 0) * 16 + k) * 2
    got = np.asarray(kernel_tables(c, q))[1, 0, 2, e : e + 2]
    assert np.allclose(got, [z.real, z.imag], rtol=1e-5, atol=1e-6)
    monkeypatch.setattr(vk, "backend", lambda: "cuda")  # a GPU as far as dispatch can tell
    assert kernel_sides(c, kp, vc, vp) is not None
    assert kernel_sides(c, kp, Uniform(4, 64, axis="channel"), vp) is None  # per-channel values
    fresh = CommVQKeys(bits=2, codebooks=synthetic("k-unread"), layer=0, rope_base=BASE)
    assert fresh.kernel_keys(kp, (1, 2, 2, 128), vc.kernel_codes(vp)) is None  # books unread
    kernel_env(monkeypatch, "VELOX_KERNELS", "0")
    assert kernel_sides(c, kp, vc, vp) is None


def test_plan_declines_what_the_kernel_does_not_lay_out(monkeypatch):
    """A group of 64 pairs a code (the authors' geometry) is more than a lane's pairs: no
    plan, so the codec returns None (the reference path) and launches nothing."""
    c = codec(bits=1, geometry={"pairs": 64, "entries": 16, "stages": 16})
    kp, vc, vp = records(c, t=8)
    ok = codec()
    okp = records(ok, t=8)[0]
    monkeypatch.setattr(vk, "backend", lambda: "metal")
    launched = []
    monkeypatch.setattr(KernelSpec, "kernel", lambda spec: launched.append(spec.name))
    keys, values = kernel_sides(c, kp, vc, vp)
    assert keys.group == 64 and kport.plan_for(2, 128, keys, values) is None
    assert attend_partial(c, queries(1, 2), kp, vc, vp) is None
    assert joint_attention(queries(1, 2), [Segment(c, kp, vc, vp)], mx.float16, 0.1) is None
    assert not launched
    assert kport.plan_for(2, 128, table_codes(ok, okp), values) is not None  # the default's


def test_bad_table_keys_are_refused(monkeypatch):
    c = codec()
    kp, vc, vp = records(c, t=16)
    monkeypatch.setattr(vk, "backend", lambda: "metal")
    keys, values = kernel_sides(c, kp, vc, vp)
    q = queries(1, 2)
    tab = kernel_tables(c, q)
    with pytest.raises(ValueError, match="q_sketch"):
        dk.decode_attention(q, keys, values)  # no tables
    with pytest.raises(ValueError, match=r"q_sketch \(1, 2, 2, 100\)"):
        dk.decode_attention(q, keys, values, q_sketch=tab[..., :100])
    pos = keys.positions.astype(mx.float32)
    with pytest.raises(ValueError, match="positions"):
        dk.decode_attention(q, dataclasses.replace(keys, positions=pos), values, q_sketch=tab)
    theta = mx.zeros((32,))
    bad = dataclasses.replace(keys, table=TableKeys(2, theta))
    with pytest.raises(ValueError, match="theta"):
        dk.decode_attention(q, bad, values, q_sketch=tab)
    three = dataclasses.replace(keys, table=TableKeys(3, keys.table.theta))
    with pytest.raises(ValueError, match="codes"):  # 3 stages need more words a token
        dk.decode_attention(q, three, values, q_sketch=kernel_tables(c, q))
    with pytest.raises(ValueError, match="TableKeys"):  # refused when built
        dataclasses.replace(keys, table=None)
    with pytest.raises(ValueError, match="keys only"):
        dk.decode_attention(q, values, keys)


# -- the emulated kernel against the reference ---------------------------------------------------


@needs_gxx
@pytest.mark.parametrize("bits", [1, 2])
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_emulated_kernel_attention_matches_the_reference(emulated_gpu, layout, bits):
    """The kernel's partial equals the reference's (scores from the codes with RoPE on the
    looked-up sums, values from their codes): two batch rows at their own positions (one
    near 0, one far out) and two query rows (GQA)."""
    c = codec(layout, bits)
    kp, vc, vp = records(c, t=300, starts=(POSITIONS["start"], POSITIONS["far"]))
    q = queries(2, 2)
    emulated_gpu.calls.clear()
    got = attend_partial(c, q, kp, vc, vp)
    assert emulated_gpu.names == ["velox_decode_attention_table", "velox_decode_merge"]
    ref = partial(q, Segment(c, kp, vc, vp))
    assert_partials_close(got, ref, 2e-5)


@needs_gxx
@pytest.mark.parametrize(
    "rows,geometry,bits",
    [
        (4, DEFAULT, 2),  # 16 channels a lane: a lane's 16 index bits a stage, in one word
        (8, DEFAULT, 1),  # 8 channels a lane: one group a lane, 8 bits
        (1, {"pairs": 8, "entries": 16, "stages": 4}, 2),  # 4 stages, 8 pairs a code
        (2, {"pairs": 1, "entries": 8, "stages": 2}, 6),  # 3-bit indices straddling words
    ],
    ids=["lanes16", "lanes8", "g8-s4", "k8-straddle"],
)
def test_emulated_kernel_lane_layouts(emulated_gpu, rows, geometry, bits):
    """Other geometries and query rows (so other lane layouts: a lane's indices an aligned
    share of a word, whole words, indices across word boundaries) at an offset."""
    c = codec("default", bits, geometry)
    kp, vc, vp = records(c, t=260, starts=(POSITIONS["offset"],), seed=5)
    q = queries(1, rows, seed=rows)
    keys, values = kernel_sides(c, kp, vc, vp)
    p = kport.plan_for(rows, 128, keys, values)
    assert p is not None and p.cpl == {1: 32, 2: 32, 4: 16, 8: 8}[rows]
    got = attend_partial(c, q, kp, vc, vp)
    assert_partials_close(got, partial(q, Segment(c, kp, vc, vp)), 2e-5)


@needs_gxx
def test_emulated_kernel_reads_strided_records(tmp_path):
    """Every token-axis input read as a slice of a longer buffer of garbage, the context in
    several splits: the kernel honours strides and split bounds."""
    c = codec("traditional", 2)
    kp, vc, vp = records(c, t=333, starts=(7, 40_000), seed=2)
    q = queries(2, 2, seed=9)
    keys, values = table_codes(c, kp), vc.kernel_codes(vp)  # (kernel_sides: None on the CPU)
    emu = Emulator(tmp_path)
    runs = [
        DecodeRun(emu, q, keys, values, splits=s, pad=pad, q_sketch=kernel_tables(c, q))
        for s, pad in ((1, 0), (3, 11), (7, 5))
    ]
    ref = partial(q, Segment(c, kp, vc, vp))
    for run in runs:
        assert_partials_close(run(), ref, 2e-5)


@needs_gxx
def test_emulated_kernel_uses_each_keys_position(emulated_gpu):
    """The same codes read at other positions score differently, as the reference does: the
    kernel rotates by the stored positions, not the token index."""
    c = codec()
    kp, vc, vp = records(c, t=64, starts=(300,))
    moved = Packed({**kp.data, "pos": kp.data["pos"] + 17}, kp.tokens)
    q = queries(1, 2)
    a, b = attend_partial(c, q, kp, vc, vp), attend_partial(c, q, moved, vc, vp)
    assert np.abs(np.asarray(a[0] - b[0])).max() > 1e-2
    assert_partials_close(b, partial(q, Segment(c, moved, vc, vp)), 2e-5)


@needs_gxx
@pytest.mark.parametrize(
    "backend,kw",
    [
        ("metal", {"window": 32, "sinks": 4}),
        ("cuda", {}),
        ("metal", {"key_bits": 1, "value_bits": 4, "window": 16, "rope_traditional": True}),
    ],
    ids=["metal-window-sinks", "cuda", "metal-1bit-traditional"],
)
def test_emulated_cache_decode_steps_match_the_reference(monkeypatch, tmp_path, backend, kw):
    """A CommVQCache attends each decode step through the decode kernel and the merge that
    joins its fp16 window and sinks in one softmax (the plan made once per coded segment,
    the query tables built per call: a new query each step), on the emulated Metal and CUDA
    instantiations, and matches the same cache attended with kernels off."""
    kw = dict(kw)
    rope = {"rope_traditional": kw.pop("rope_traditional", False)}
    lay = (128, int(rope["rope_traditional"]))
    path = synthetic(f"cache-{lay[1]}", layout=lay, **DEFAULT)
    kw = {"key_bits": 2, "value_bits": 4, **kw}
    cache = CommVQCache(codebooks=path, layer=0, rope_base=BASE, **rope, **kw)
    k = mx.random.normal((1, 2, 403, 128), key=mx.random.key(11)).astype(mx.float16)
    v = mx.random.normal((1, 2, 403, 128), key=mx.random.key(12)).astype(mx.float16)
    fake = EmulatedKernels(tmp_path, backend=backend).install(monkeypatch)
    cache.update_and_fetch(k[:, :, :400], v[:, :, :400])
    merge = "velox_decode_merge_fp16"
    for step in range(3):
        cache.update_and_fetch(k[:, :, 400 + step : 401 + step], v[:, :, 400 + step : 401 + step])
        q = mx.random.normal((1, 4, 1, 128), key=mx.random.key(20 + step)).astype(mx.float16)
        fake.calls.clear()
        got = cache.attend(q, 1 / math.sqrt(128))
        assert fake.names == ["velox_decode_attention_table", merge], fake.names
        with kcfg.configured(enabled=False):
            ref = cache.attend(q, 1 / math.sqrt(128))
        err = np.abs(np.asarray((got - ref).astype(mx.float32))).max()
        assert err < 2e-3 * max(1.0, float(mx.max(mx.abs(ref)))), (step, err)
