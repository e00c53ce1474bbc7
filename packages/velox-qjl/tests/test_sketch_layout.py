"""QJL's layout in velox-core's portable decode kernel, checked without a GPU.

The sketch keys' records (:mod:`velox_qjl.layout`), their lanes and plan, their checks, the
portable kernel with this package's key pass compiled for Metal (the C++ shim) and CUDA
(nvcc, where installed), and its scores against a numpy reference through the emulated
Metal instantiation (``velox_testing.emulate``).
"""

from __future__ import annotations

import dataclasses
import math

import mlx.core as mx
import numpy as np
import pytest

import velox_core.kernels as vk
from velox_core.kernels import decode as dk
from velox_core.kernels import layout as klayout
from velox_core.kernels import portable as kport
from velox_core.kernels import records as krec
from velox_core.kernels.build import ArgInfo
from velox_core.ops import pack
from velox_qjl.layout import (
    SKETCH,
    QJLKernelConfig,
    SketchCodes,
    SketchKeys,
    SketchLayout,
    sketch_lanes,
    sketch_matrix,
)
from velox_testing import (
    assert_partials_close,
    kernel_env,
    needs_gxx,
)
from velox_testing.emulate import DecodeRun, Emulator
from velox_testing.kernel_path import INSTANTIATIONS, compile_instantiation

# placeholder arrays for records that only the plans and templates read (their layout)
_U32, _F16 = mx.zeros((1,), mx.uint32), mx.zeros((1,), mx.float16)
F32, U32, H16 = ("float32", 4, 1 << 20), ("uint32", 4, 1 << 20), ("float16", 4, 1 << 20)
DUMMY = ("float32", 1, 8)


def test_the_sketch_layout_is_registered_with_its_key_pass():
    keys = _sketch_codes(256, 256, 8)
    lay = klayout.layout_of(keys)
    assert type(lay) is SketchLayout and keys.kind == SKETCH and lay.keys_only
    assert lay.butterfly and lay.split_block(keys) == 32
    assert lay.split_block(_sketch_codes(256, 0, 0)) == 1
    spec = kport.decode_spec(keys)
    assert spec.name == "velox_decode_attention_sketch"
    assert spec.inserts == ((kport.KEY_PASS, "decode_sketch_keys.metal", "velox_qjl"),)
    assert "KOSK" in spec.body("metal") and "KOSK" not in kport.DECODE.body("metal")


def test_settings_are_read_once_and_checked(monkeypatch):
    assert kernel_env(monkeypatch, "VELOX_DECODE_SKETCH_LANES", "8").lanes == 8
    assert QJLKernelConfig.current().lanes == 8 and sketch_lanes(256, 256) == 8
    with QJLKernelConfig.configured(lanes=16):
        assert sketch_lanes(256, 256) == 16
    assert kernel_env(monkeypatch, "VELOX_SKETCH_MMA_LO", "0").mma_lo is False
    with pytest.raises(ValueError, match="VELOX_SKETCH_MMA_AHEAD must be one of 1, 2"):
        kernel_env(monkeypatch, "VELOX_SKETCH_MMA_AHEAD", "3")
    with pytest.raises(ValueError, match="VELOX_SKETCH_MMA_DIFF must be 0 or 1"):
        kernel_env(monkeypatch, "VELOX_SKETCH_MMA_DIFF", "yes")
    with pytest.raises(TypeError, match="QJLKernelConfig.mma_bsm must be True or False"):
        QJLKernelConfig(mma_bsm=1)


def test_records_are_checked_when_built():
    lev = mx.zeros((16,), mx.float32)
    sk = SketchKeys(m=256, mo=0, outliers=0, index_bits=7, const=1.25, lanes=32, matrix=lev)
    u32, f16 = mx.zeros((1, 1, 4, 16), mx.uint32), mx.zeros((1, 1, 4), mx.float16)
    rec = SketchCodes(codes=u32, norm=f16, sketch=sk)
    assert (rec.bits, rec.group, rec.onorm, rec.b, rec.a) == (1, 1, None, None, f16)
    with pytest.raises(ValueError, match="SketchCodes: group"):
        SketchCodes(codes=u32, norm=f16, sketch=sk, group=0)
    with pytest.raises(ValueError, match="sketch must be a SketchKeys record"):
        SketchCodes(codes=u32, norm=f16, sketch=lev)
    with pytest.raises(TypeError, match="onorm must be an mx.array"):
        SketchCodes(codes=u32, norm=f16, sketch=sk, onorm=0.0)
    with pytest.raises(ValueError, match="SketchCodes: norm is required"):
        SketchCodes(codes=u32, norm=None, sketch=sk)


def _sketch_codes(m: int, mo: int, k: int, group: int = 32) -> SketchCodes:
    sk = SketchKeys(m, mo, k, 7, 1.25, sketch_lanes(m, mo), None)
    onorm = _F16 if k else None
    return SketchCodes(codes=_U32, norm=_F16, onorm=onorm, group=group if k else 1, sketch=sk)


def test_sketch_keys_lanes_and_plan():
    """Sketch keys (QJL): the key pass's lanes split both sketches into shares of at most a
    word or of whole words, the rows' weights fit the register budget, and splits start on
    whole outlier blocks."""
    assert sketch_lanes(256, 256) == 32  # 8 bits a lane: the paper's m = 2d at d = 128
    assert sketch_lanes(320, 64) == 32  # 10 bits a lane, straddling words
    assert sketch_lanes(128, 0) == 32
    assert sketch_lanes(100, 15) == 0  # 15 outlier bits: one lane with 100 bits
    assert sketch_lanes(96, 0) == 32 and sketch_lanes(192, 0) == 32
    vals = krec.AffineCodes(bits=4, group=64, codes=_U32, scale=_F16, zero=_F16)
    keys = _sketch_codes(256, 256, 8)
    p = kport.plan_for(4, 128, keys, vals)
    assert (p.mb, p.cpl) == (4, 16)  # 16 weights a row: 4 rows
    assert dict(kport.template(p, 128, keys, vals))["KLPT"] == 32
    assert dict(kport.template(p, 128, keys, vals))["KSPAN"] == 32  # splits of whole blocks
    p = kport.plan_for(8, 128, _sketch_codes(1024, 1024, 8), vals)
    assert (p.mb, p.nmb) == (1, 8)  # 64 weights a row: one row a block
    assert kport.plan_for(4, 128, _sketch_codes(4096, 0, 0), vals) is None  # 128 weights a row
    assert kport.plan_for(4, 128, _sketch_codes(100, 15, 8), vals) is None  # no lane layout
    keys = _sketch_codes(256, 256, 8, group=96)
    p = kport.plan_for(4, 128, keys, vals)  # 1024 tokens at most a split
    for t in (96, 1000, 4000, 131072):
        for s0 in (1, 3, 7, 128):
            s = kport.block_splits(t, kport.fit_splits(t, s0, p), p, keys)
            span = math.ceil(math.ceil(t / s) / 96) * 96  # what the kernel takes
            assert span <= p.max_span and s * span >= t
    assert kport.block_splits(4000, 5, p, _sketch_codes(256, 0, 0)) == 5  # no blocks: unchanged
    for t, s0 in ((1000, 7), (4000, 3), (97, 2)):
        s = kport.block_splits(t, s0, p, keys)
        span = math.ceil(math.ceil(t / s) / 96) * 96
        assert (s - 1) * span < t <= s * span  # no split left empty
    assert kport.plan_for(4, 128, _sketch_codes(256, 256, 8, group=2048), vals) is None
    assert kport.plan_for(1, 128, _sketch_codes(256, 256, 8, group=2048), vals) is not None
    p = kport.plan_for(4, 128, _sketch_codes(128, 128, 16), vals)
    assert p.mb == 2  # 16 outlier coordinates a row: two rows within half the budget


def test_sketch_keys_bad_input_is_refused(monkeypatch):
    """Sketch keys' arrays are checked against the sketch's sizes before any launch, and the
    sketched query must come in their size; sketch codes are for keys only."""
    monkeypatch.setattr(vk, "backend", lambda: "metal")
    b, h, t, d, m = 1, 2, 64, 128, 256
    proj = mx.random.normal((m, d)).astype(mx.float16)
    mat = sketch_matrix(proj, m, m, 32)
    assert mat.shape == (d, m)
    u32 = lambda *shape: mx.zeros(shape, mx.uint32)  # noqa: E731
    good = dict(osign=u32(b, h, t, 8), idx=u32(b, h, t // 32, 2))
    sk = SketchKeys(m, m, 8, 7, 1.25, 32, mat, **good)
    norm = mx.ones((b, h, t), mx.float16)
    keys = SketchCodes(codes=u32(b, h, t, 8), norm=norm, onorm=norm, group=32, sketch=sk)
    vals = krec.AffineCodes(
        bits=4,
        group=64,
        codes=u32(b, h, t, 16),
        scale=mx.ones((b, h, t, 2)),
        zero=mx.zeros((b, h, t, 2)),
    )
    q = mx.zeros((b, h, 4, d))
    with pytest.raises(ValueError, match="q_sketch"):
        dk.decode_attention(q, keys, vals)
    with pytest.raises(ValueError, match="q_sketch"):
        dk.decode_attention(q, keys, vals, q_sketch=mx.zeros((b, h, 4, d)))
    qs = mx.zeros((b, h, 4, m))
    bad = SketchKeys(m, m, 8, 7, 1.25, 32, mat, good["osign"], u32(b, h, t // 16, 2))
    with pytest.raises(ValueError, match="idx"):
        dk.decode_attention(q, dataclasses.replace(keys, sketch=bad), vals, q_sketch=qs)
    with pytest.raises(ValueError, match="sketch matrix"):
        wrong = SketchKeys(m, m, 8, 7, 1.25, 32, proj, **good)  # S itself, not its layout
        dk.decode_attention(q, dataclasses.replace(keys, sketch=wrong), vals, q_sketch=qs)
    with pytest.raises(ValueError, match="laid out for 16 lanes"):
        other = SketchKeys(m, m, 8, 7, 1.25, 16, sketch_matrix(proj, m, m, 16), **good)
        dk.decode_attention(q, dataclasses.replace(keys, sketch=other), vals, q_sketch=qs)
    with pytest.raises(ValueError, match="index_bits"):
        six = SketchKeys(m, m, 8, 6, 1.25, 32, mat, **good)  # 6 bits cannot index 128
        dk.decode_attention(q, dataclasses.replace(keys, sketch=six), vals, q_sketch=qs)
    with pytest.raises(ValueError, match="keys only"):
        dk.decode_attention(q, vals, keys)
    with pytest.raises(ValueError, match="VELOX_DECODE_SKETCH_LANES"):
        kernel_env(monkeypatch, "VELOX_DECODE_SKETCH_LANES", "3")


def _variants():
    """The portable kernel with the key pass as the host lays it out: outliers with one row
    set for both sketches, two row sets with shares straddling words, and no outliers."""
    vside = krec.AffineCodes(bits=4, group=64, codes=_U32, scale=_F16, zero=_F16)
    out = []
    for m, mo, k, m_rows in ((256, 256, 8, 4), (320, 64, 8, 8), (256, 0, 0, 4)):
        kside = _sketch_codes(m, mo, k)
        p = kport.plan_for(m_rows, 128, kside, vside)
        f16 = ("float16", 3, 1 << 20)
        ins = [U32, f16, f16 if k else ("float16", 1, 8), DUMMY, U32, H16, H16, DUMMY]
        extra = [U32 if k else DUMMY, ("float16", 1, 8), F32]
        extra += [U32, ("float16", 2, 1 << 16)] if k else [DUMMY, DUMMY]
        infos = [ArgInfo(*a) for a in [F32, *ins, *extra]]
        out.append(
            (kport.decode_spec(kside), infos, ["float32"] * 2, kport.template(p, 128, kside, vside))
        )
    return out


@pytest.mark.parametrize("backend", INSTANTIATIONS)
def test_the_key_pass_compiles_in_each_instantiation(tmp_path, backend):
    compile_instantiation(backend, _variants(), tmp_path)


@needs_gxx
@pytest.mark.parametrize(
    "m_sk,mo,k,group,rows,pad,splits,lanes",
    [
        (256, 256, 8, 32, 4, 0, 3, 32),  # the paper's setting: both sketches on the same rows
        (320, 64, 8, 48, 3, 5, 4, 32),  # shares straddling words, blocks across split targets
        (128, 0, 0, 1, 4, 3, 3, 32),  # no outliers
        (128, 512, 4, 64, 2, 0, 3, 32),  # a larger outlier sketch, a partial last block
        (256, 256, 8, 32, 4, 2, 5, 8),  # 8 lanes: 32-bit shares, one query row a block
    ],
)
def test_decode_kernel_scores_sketch_keys(
    monkeypatch, tmp_path, m_sk, mo, k, group, rows, pad, splits, lanes
):
    """QJL keys through the key pass: per token ``c/m n_in <S q - S P q, sign_in> + c/m_o n_o
    <S P q, sign_o>`` with ``P`` the block's outlier channels, against a numpy reference built from
    random signs, norms, indices and ``S`` (strided slices with garbage beyond when ``pad``;
    blocks of 48 tokens, split starts rounded up to them; a partial last block; 8 lanes a
    token through ``VELOX_DECODE_SKETCH_LANES``)."""
    rng = np.random.default_rng(m_sk + k)
    b, h, t, d, vbits = 1, 2, 480, 128, 4
    nb = -(-t // group)
    kernel_env(monkeypatch, "VELOX_DECODE_SKETCH_LANES", str(lanes))
    sgn = rng.integers(0, 2, size=(b, h, t, m_sk))
    norm = (rng.random((b, h, t)) + 0.5).astype(np.float16)
    proj = rng.standard_normal((max(m_sk, mo), d)).astype(np.float16)
    q = rng.standard_normal((b, h, rows, d)).astype(np.float32) * 0.3
    sq = q @ proj[:m_sk].astype(np.float32).T  # (B, H, M, m)
    assert sketch_lanes(m_sk, mo) == lanes
    mat = sketch_matrix(mx.array(proj), m_sk, mo, lanes)
    sq_lanes = mx.array(q) @ mat[:, :m_sk].astype(mx.float32)  # S q in the lanes' order
    c = 1.2533
    sketch = SketchKeys(m_sk, mo, k, 7, c, lanes, mat)
    onorm = None
    if k:
        idx = np.array([rng.choice(d, k, replace=False) for _ in range(b * h * nb)])
        idx = np.sort(idx, -1).reshape(b, h, nb, k)
        osgn = rng.integers(0, 2, size=(b, h, t, mo))
        onorm = (rng.random((b, h, t)) * 0.4).astype(np.float16)
        sketch = SketchKeys(
            m_sk,
            mo,
            k,
            7,
            c,
            lanes,
            mat,
            pack(mx.array(osgn), 1),
            pack(mx.array(idx.astype(np.int32)), 7),
        )
    keys = SketchCodes(
        codes=pack(mx.array(sgn), 1),
        norm=mx.array(norm),
        onorm=None if onorm is None else mx.array(onorm),
        group=group,
        sketch=sketch,
    )
    vcodes = rng.integers(0, 1 << vbits, size=(b, h, t, d))
    vscale = (rng.random((b, h, t, 2)) * 0.1).astype(np.float16)
    vzero = (rng.standard_normal((b, h, t, 2)) * 0.1).astype(np.float16)
    vals = krec.AffineCodes(
        bits=vbits,
        group=64,
        codes=pack(mx.array(vcodes), vbits),
        scale=mx.array(vscale),
        zero=mx.array(vzero),
    )
    got = DecodeRun(
        Emulator(tmp_path), mx.array(q), keys, vals, splits=splits, pad=pad, q_sketch=sq_lanes
    )()
    # the reference, per block
    s_in = np.zeros((b, h, rows, t))
    s_out = np.zeros((b, h, rows, t))
    pf = proj.astype(np.float64)
    for blk in range(nb):
        sl = slice(blk * group, (blk + 1) * group)
        spq = np.zeros((b, h, rows, max(m_sk, mo)))
        if k:
            ch = idx[0, :, blk]  # (H, k)
            for hh in range(h):
                spq[0, hh] = q[0, hh][:, ch[hh]] @ pf[:, ch[hh]].T
        sg = sgn[:, :, sl] * 2.0 - 1.0
        s_in[..., sl] = np.einsum("bhmi,bhti->bhmt", sq - spq[..., :m_sk], sg) * c / m_sk
        if k:
            og = osgn[:, :, sl] * 2.0 - 1.0
            s_out[..., sl] = np.einsum("bhmi,bhti->bhmt", spq[..., :mo], og) * c / mo
    sc = s_in * norm.astype(np.float64)[:, :, None]
    if k:
        sc = sc + s_out * onorm.astype(np.float64)[:, :, None]
    vx = vcodes * np.repeat(vscale, 64, -1).astype(np.float64)
    vx = vx + np.repeat(vzero, 64, -1).astype(np.float64)
    mref = sc.max(axis=-1, keepdims=True)
    p = np.exp(sc - mref)
    ref = (p @ vx, mref, p.sum(axis=-1, keepdims=True))
    assert_partials_close(got, ref, 5e-5)
