"""velox's GPU kernels, checked on a machine without a GPU.

* Dispatch: the CPU backend and ``VELOX_KERNELS=0`` take the reference; on a (faked) GPU
  backend, attention and encoding go through the kernel entry points.
* Layout: which shapes the decode kernel takes, and how it splits a context.
* Compile checks: the Metal instantiation of every kernel (the full function MLX's
  ``metal_kernel`` generates) compiles with g++ through ``metal/shim``, and the CUDA
  instantiation (what ``cuda_kernel`` generates) compiles with nvcc, without register spills.
* Emulation: the Metal instantiation runs on the CPU (``velox_testing.emulate``: real
  threads, barriers and SIMD shuffles) and matches the MLX reference: decode attention for
  2 to 8 bits, query blocks, padding, bf16 scales, strided slices of a larger buffer, split
  counts that do not divide the context; the merge of partials; the encode kernels bit for bit.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import math
import os
import re
import shutil
import subprocess

import mlx.core as mx
import numpy as np
import pytest

import velox_core.kernels as vk
from velox_core import Identity, Uniform, UniformCache, ops
from velox_core.cache.attention import (
    Segment,
    attend,
    fused_partial,
    kernel_sides,
    merge_partials,
    partial,
)
from velox_core.kernels import config as kcfg
from velox_core.kernels import decode as dk
from velox_core.kernels import encode as ek
from velox_core.kernels import layout as klayout
from velox_core.kernels import merge as kmerge
from velox_core.kernels import mma as kmma
from velox_core.kernels import mma_support as kmsup
from velox_core.kernels import portable as kport
from velox_core.kernels import records as krec
from velox_core.kernels.build import PROLOGUE, ArgInfo, cuda_source
from velox_core.ops import affine_quantize, pack, unpack
from velox_testing import compile_cuda, compile_metal, kernel_env, kv_data, needs_nvcc, sign_words
from velox_testing.emulate import (
    CudaEmulator,
    DecodeRun,
    EmulatedKernels,
    Emulator,
    mma_fused_parts,
    np_input,
    shim_dir,
)
from velox_testing.metal_source import metal_source

GXX = shutil.which(os.environ.get("CXX", "g++"))
needs_gxx = pytest.mark.skipif(
    GXX is None, reason="g++ is not installed: the Metal instantiation cannot be compiled here"
)
SOURCES = (
    "decode_attention.metal",
    "decode_merge.metal",
    "encode_affine.metal",
    "encode_sketch.metal",
    "velox_kernels.h",
)


def uniform_case(b, h, t, m, bits, group=64, dtype=mx.float16, dim=128, seed=0, vbits=None):
    """Keys, values, query and their Uniform records and reference partial."""
    key = mx.random.key(seed)
    k1, k2, k3 = mx.random.split(key, 3)
    k = mx.random.normal((b, h, t, dim), key=k1).astype(dtype)
    v = mx.random.normal((b, h, t, dim), key=k2).astype(dtype)
    q = mx.random.normal((b, h, m, dim), key=k3) * 0.3
    kc, vc = Uniform(bits, group), Uniform(vbits or bits, group)
    kp, vp = kc.encode(k), vc.encode(v)
    ref = partial(q, Segment(kc, kp, vc, vp))
    keys, vals = kc.kernel_codes(kp), vc.kernel_codes(vp)  # AffineCodes of the records
    return q, keys, vals, ref


# placeholder arrays for records that only the plans and templates read (their layout)
_U32, _F16 = mx.zeros((1,), mx.uint32), mx.zeros((1,), mx.float16)


def _layout(kind: int, bits: int, group: int, **kw) -> krec.CodeRecord:
    """A record of one layout with placeholder arrays (``kw``: its other fields)."""
    if kind == krec.CODEBOOK:
        return krec.CodebookCodes(bits=bits, dim=group, codes=_U32, norm=_F16, levels=_F16, **kw)
    record = krec.AffineCodes if kind == krec.AFFINE else krec.ChannelAffineCodes
    return record(bits=bits, group=group, codes=_U32, scale=_F16, zero=_F16)


def assert_partial_close(got, ref, tol=2e-5):
    o, m, l = (np.asarray(x) for x in got)
    ro, rm, rl = (np.asarray(x) for x in ref)
    assert o.shape == ro.shape and m.shape == rm.shape and l.shape == rl.shape
    assert np.abs(m - rm).max() <= tol * max(1.0, np.abs(rm).max())
    assert np.abs(l - rl).max() <= tol * np.abs(rl).max()
    assert np.abs(o - ro).max() <= tol * np.abs(ro).max()


# -- dispatch -------------------------------------------------------------------------------------


def test_cpu_backend_takes_the_reference():
    if mx.default_device().type == mx.DeviceType.gpu:
        pytest.skip("the default device is a GPU")
    assert vk.backend() == "cpu" and not vk.use_kernels()
    q, keys, vals, _ = uniform_case(1, 1, 16, 4, 4)
    kp = {"codes": keys.codes, "scale": keys.scale, "zero": keys.zero}
    vp = {"codes": vals.codes, "scale": vals.scale, "zero": vals.zero}
    from velox_core import Packed

    out = fused_partial(q, Segment(Uniform(4), Packed(kp, 16), Uniform(4), Packed(vp, 16)))
    assert out is None


def test_velox_kernels_0_forces_the_reference(monkeypatch):
    monkeypatch.setattr(vk, "backend", lambda: "cuda")
    for off in ("0", "false", "off", "no"):
        kernel_env(monkeypatch, "VELOX_KERNELS", off)
        assert not vk.kernels_enabled() and not vk.use_kernels()
    kernel_env(monkeypatch, "VELOX_KERNELS", "1")
    assert vk.kernels_enabled() and vk.use_kernels()


def test_kernel_sides_decline_what_the_kernel_does_not_cover(monkeypatch):
    q = mx.zeros((1, 1, 4, 128))
    k, v = kv_data(t=64)
    tok = Uniform(4)
    chan = Uniform(4, group=32, axis="channel")
    kp_c, vp_c, vp_t = chan.encode(k), chan.encode(v), tok.encode(v)  # on the CPU path
    monkeypatch.setattr(vk, "backend", lambda: "cuda")  # a GPU as far as dispatch can tell
    called = []
    monkeypatch.setattr(dk, "decode_attention", lambda *a, **k: called.append(a) or None)
    vi = Identity().encode(v)
    assert fused_partial(q, Segment(chan, kp_c, chan, vp_c)) is None  # per-channel value groups
    assert fused_partial(q, Segment(tok, kp_c, Identity(), vi)) is None  # values with no side
    assert not called
    assert kernel_sides(chan, kp_c, tok, vp_t, q.shape) is not None  # KIVI's pair


def test_uniform_encode_and_attend_route_to_the_kernels_on_a_gpu(monkeypatch):
    """With a (faked) GPU backend, encode() calls the fused encode kernel and attend() the
    fused decode kernel; both are replaced by spies that return the reference results."""
    k, v = kv_data(t=300)
    cache = UniformCache(bits=4, window=16, sinks=4)
    cache.update_and_fetch(k, v)  # encoded on the CPU path
    q = mx.random.normal((1, 4, 1, 128), key=mx.random.key(5)).astype(mx.float16)
    ref = cache.attend(q, 0.1)

    monkeypatch.setattr(vk, "backend", lambda: "cuda")
    seen = {}

    def spy_plan(q_shape, q_dtype, keys, values, splits=None, fp16_tokens=None, **kw):
        seen["joint"] = (q_shape, fp16_tokens)  # the joint call (sinks and window): declined
        return None

    def spy_decode(qq, keys, values, splits=None, fp16=None, out_dtype=None, scale=None, **kw):
        seen["decode"] = (qq.shape, keys.bits, keys.kind, values.kind, keys.codes.shape)
        kc, vc = Uniform(keys.bits, keys.group), Uniform(values.bits, values.group)
        kp = {"codes": keys.codes, "scale": keys.scale, "zero": keys.zero}
        vp = {"codes": values.codes, "scale": values.scale, "zero": values.zero}
        from velox_core import Packed

        t = keys.codes.shape[2]
        return partial(qq, Segment(kc, Packed(kp, t), vc, Packed(vp, t)))

    def spy_encode(x, bits, group, clip=1.0):
        seen["encode"] = (x.shape, bits, group, clip)
        codes, scale, zero = affine_quantize(x, bits, group, "token", clip)
        return pack(codes, bits), scale, zero

    monkeypatch.setattr(dk, "plan_decode", spy_plan)
    monkeypatch.setattr(dk, "decode_attention", spy_decode)
    monkeypatch.setattr(ek, "affine_encode", spy_encode)
    got = cache.attend(q, 0.1)
    assert seen["joint"] == ((1, 2, 2, 128), 4 + 16)  # sinks and window offered
    assert seen["decode"] == ((1, 2, 2, 128), 4, krec.AFFINE, krec.AFFINE, (1, 2, 280, 16))
    assert mx.allclose(got, ref, atol=2e-3).item()
    Uniform(3, 32).encode(k[:, :, :8])
    assert seen["encode"] == ((1, 2, 8, 128), 3, 32, 1.0)


def test_compact_drops_comments_and_keeps_code():
    from velox_core.kernels.build import compact

    src = (
        "#define A 1 // one\n"
        "  int x = a / b; /* c */ int y = 2;\n"
        "\n"
        "  // only a comment\n"
        'const char* s = "a // b /* c \\" */";\n'
        "char q = '/'; char e = '\\'';\n"
        "#if A \\\n"
        "  && 1\n"
        "#endif\n"
        "/* two\n"
        "lines */ z = 3;\n"
    )
    assert compact(src) == (
        "#define A 1\n"
        "int x = a / b;   int y = 2;\n"
        'const char* s = "a // b /* c \\" */";\n'
        "char q = '/'; char e = '\\'';\n"
        "#if A \\\n"
        "&& 1\n"
        "#endif\n"
        "z = 3;\n"
    )


def test_kernel_sources_are_found_and_assembled():
    for name in SOURCES:
        assert vk.kernel_source(name).strip()
    with pytest.raises(FileNotFoundError):
        vk.kernel_source("no_such_kernel.metal")
    for backend in ("metal", "cuda"):
        head, body = kport.DECODE.header(backend), kport.DECODE.body(backend)
        assert head.startswith(f"#define VX_{backend.upper()} 1") and "VELOX_KERNELS_H" in head
        assert body.startswith(PROLOGUE[backend])
    with pytest.raises(ValueError, match="backend"):
        kport.DECODE.body("opencl")


def test_get_kernel_builds_once_per_backend(monkeypatch):
    monkeypatch.setattr(vk, "_BUILT", {})
    built = []
    assert vk.get_kernel("x", lambda be: built.append(be) or len(built)) == 1
    assert vk.get_kernel("x", lambda be: built.append(be) or len(built)) == 1
    assert built == [vk.backend()]


# -- layout and splits ----------------------------------------------------------------------------


def test_plan_layouts_and_declines():
    p = kport.plan(4, 128, krec.AFFINE, 4, 64, krec.AFFINE, 4, 64)
    assert (p.cpl, p.mb, p.nmb, p.lanes) == (16, 4, 1, 8)
    p = kport.plan(4, 128, krec.CODEBOOK, 3, 128, krec.CODEBOOK, 3, 128)
    assert (p.cpl, p.mb, p.nmb, p.lanes) == (32, 2, 2, 4)  # 3-bit rows: 32 channels = 3 words
    p = kport.plan(7, 128, krec.AFFINE, 8, 32, krec.AFFINE, 8, 32)
    assert (p.cpl, p.mb, p.nmb) == (8, 8, 1) and p.max_span == 512
    p = kport.plan(1, 80, krec.AFFINE, 4, 16, krec.AFFINE, 2, 16)
    assert p.cpl == 16 and p.lanes == 8  # 5 lanes of data, padded to 8
    assert kport.plan(4, 96, krec.AFFINE, 4, 24, krec.AFFINE, 4, 24).cpl == 8  # 3 lanes per group
    assert kport.plan(4, 96, krec.AFFINE, 4, 12, krec.AFFINE, 4, 12) is None  # 12 vs 8/16/32 lanes
    assert (
        kport.plan(4, 100, krec.AFFINE, 4, 4, krec.AFFINE, 4, 4) is None
    )  # no lane width divides 100
    assert kport.plan(4, 2048, krec.AFFINE, 4, 64, krec.AFFINE, 4, 64) is None  # more than 32 lanes


def test_plan_widens_the_register_budget_for_32_channel_lanes_on_cuda(monkeypatch):
    """On CUDA, lanes of 32 channels (3-, 5-, 7-bit codes) hold 4 query rows (one pass over
    the codes where two would read them twice); Metal keeps the budget, as do lanes of 16
    channels, sketches and GQA beyond 4 rows at 16 channels."""
    three = (krec.CODEBOOK, 3, 128, krec.CODEBOOK, 3, 128)
    for backend, want in (("cuda", (32, 4, 1)), ("metal", (32, 2, 2)), ("cpu", (32, 2, 2))):
        monkeypatch.setattr(vk, "backend", lambda b=backend: b)
        p = kport.plan(4, 128, *three)
        assert (p.cpl, p.mb, p.nmb) == want, backend
        assert p.max_span == kport.SCORE_SLOTS // p.mb
    monkeypatch.setattr(vk, "backend", lambda: "cuda")
    assert kport.plan(8, 128, krec.AFFINE, 5, 32, krec.AFFINE, 7, 32).mb == 4  # 8 rows: two passes
    p = kport.plan(4, 128, krec.AFFINE, 4, 64, krec.AFFINE, 4, 64)
    assert (p.cpl, p.mb) == (16, 4)  # unchanged
    assert (
        kport.plan(8, 128, krec.AFFINE, 2, 64, krec.AFFINE, 2, 64).mb == 4
    )  # 16 channels: as before
    assert kport.plan(4, 128, krec.CODEBOOK, 3, 128, krec.CODEBOOK, 3, 128, sketch=True).mb == 1


@pytest.mark.parametrize("t", [1, 7, 255, 256, 1000, 4097, 32768, 131072, 131071])
@pytest.mark.parametrize("rows", [1, 8, 64])
def test_splits_cover_the_context_without_empty_or_oversized_splits(t, rows):
    for m, bits in ((4, 4), (8, 4), (1, 2), (4, 3)):
        p = kport.plan(m, 128, krec.AFFINE, bits, 64, krec.AFFINE, bits, 64)
        for s in (
            kport.choose_splits(t, rows, p),
            kport.fit_splits(t, 3, p),
            kport.fit_splits(t, 10**6, p),
        ):
            span = math.ceil(t / s)  # what the kernel takes per split
            assert 1 <= s <= t and (s - 1) * span < t <= s * span and span <= p.max_span


def test_splits_follow_the_block_target(monkeypatch):
    p = kport.plan(4, 128, krec.AFFINE, 4, 64, krec.AFFINE, 4, 64)
    assert kport.choose_splits(131072, 8, p) == 128  # 1024 threadgroups of 1024 tokens
    kernel_env(monkeypatch, "VELOX_DECODE_BLOCKS", "4096")
    assert kport.choose_splits(131072, 8, p) == 512
    with pytest.raises(ValueError, match="VELOX_DECODE_WARPS"):
        kernel_env(monkeypatch, "VELOX_DECODE_WARPS", "3")


# -- compile checks (no GPU needed) ---------------------------------------------------------------

F32, U32, H16 = ("float32", 4, 1 << 20), ("uint32", 4, 1 << 20), ("float16", 4, 1 << 20)
DUMMY = ("float32", 1, 8)


def _decode_variants():
    out = []
    for kind, bits, m, group, sketch in (
        (krec.AFFINE, 2, 4, 64, False),
        (krec.AFFINE, 4, 4, 64, False),
        (krec.AFFINE, 8, 4, 64, False),
        (krec.AFFINE, 4, 8, 8, False),
        (krec.CODEBOOK, 3, 4, 128, False),
        (krec.CODEBOOK, 4, 1, 128, False),
        (krec.CODEBOOK, 2, 4, 128, True),  # TurboQuant_prod keys: the residual sketch term
    ):
        p = kport.plan(m, 128, kind, bits, group, kind, bits, group, sketch)
        side = _layout(kind, bits, group)
        ks = _layout(kind, bits, group, signs=_U32, rnorm=_F16) if sketch else side
        if kind == krec.AFFINE:
            ins = [U32, H16, H16, DUMMY]
        else:
            ins = [U32, ("float16", 3, 1 << 20), ("float16", 1, 8), ("float32", 1, 16)]
        extra = [U32, ("float16", 3, 1 << 20), F32] if sketch else [DUMMY, DUMMY, DUMMY]
        extra += [DUMMY, DUMMY]
        infos = [ArgInfo(*F32), *(ArgInfo(*a) for a in ins), *(ArgInfo(*a) for a in ins)]
        infos += [ArgInfo(*a) for a in extra]
        tmpl = kport.template(p, 128, ks if sketch else side, side)
        assert dict(tmpl)["KRSK"] == int(sketch)
        out.append((kport.DECODE, infos, ["float32"] * 2, tmpl))
    # 3-bit codes with 4 rows a pass (lanes of 32 channels on CUDA: CUDA_WIDE_REGS)
    for kind in (krec.AFFINE, krec.CODEBOOK):
        grp = 64 if kind == krec.AFFINE else 128
        p = kport.plan(4, 128, kind, 3, grp, kind, 3, grp)
        p = dataclasses.replace(p, mb=4, nmb=1, max_span=kport.SCORE_SLOTS // 4)
        side = _layout(kind, 3, grp)
        if kind == krec.AFFINE:
            ins = [U32, H16, H16, DUMMY]
        else:
            ins = [U32, ("float16", 3, 1 << 20), ("float16", 1, 8), ("float32", 1, 16)]
        infos = [ArgInfo(*F32), *(ArgInfo(*a) for a in ins), *(ArgInfo(*a) for a in ins)]
        infos += [ArgInfo(*DUMMY)] * 5
        out.append((kport.DECODE, infos, ["float32"] * 2, kport.template(p, 128, side, side)))
    # KIVI's layout: per-channel key scales (B, H, T / 32, D), per-token values
    p = kport.plan(4, 128, krec.AFFINE_CHANNEL, 4, 32, krec.AFFINE, 4, 64)
    kside = _layout(krec.AFFINE_CHANNEL, 4, 32)
    vside = _layout(krec.AFFINE, 4, 64)
    ins = [U32, H16, H16, DUMMY]
    infos = [ArgInfo(*F32), *(ArgInfo(*a) for a in ins), *(ArgInfo(*a) for a in ins)]
    infos += [ArgInfo(*DUMMY)] * 5
    out.append((kport.DECODE, infos, ["float32"] * 2, kport.template(p, 128, kside, vside)))
    out.append((kmerge.MERGE, [ArgInfo("float32", 5, 1 << 20)] * 2, ["float32"] * 3, []))
    part, seg, dummy = ArgInfo("float32", 5, 1 << 20), ArgInfo(*H16), ArgInfo("float16", 1, 8)
    for has_a, has_b, odt, rd in (
        (1, 1, "float16", 1),
        (1, 0, "bfloat16", 1),
        (0, 0, "float32", 1),
        (1, 1, "float16", 128),  # rotated partials (TurboQuant)
    ):
        a = [seg, seg] if has_a else [dummy, dummy]
        bb = [seg, seg] if has_b else [dummy, dummy]
        tmpl = [
            ("HAS_A", has_a),
            ("HAS_B", has_b),
            ("FMAX", klayout.FP16_MAX),
            ("QMUL", klayout.qmul_bits(0.088)),
            ("RD", rd),
        ]
        rot = ArgInfo("float32", 2, 1 << 20) if rd > 1 else ArgInfo("float32", 1, 8)
        ins = [part, part, ArgInfo(odt, 4, 1 << 20), *a, *bb, rot]  # query in the model dtype
        out.append((kmerge.MERGE_FP16, ins, [odt, "float32", "float32"], tmpl))
    for dtype, st in (("float16", mx.float16), ("bfloat16", mx.bfloat16), ("float32", mx.float16)):
        tmpl = [("BITS", 3), ("HD", 128), ("GROUP", 32), ("CLIPB", ek.clip_bits(0.9))]
        tmpl += [("ST", st)]
        out.append((ek.AFFINE_ENCODE, [ArgInfo(dtype, 2, 1 << 20)], ["uint32", st, st], tmpl))
    # QJL sketches: the paper's outliers (m = m_o = 256), m = 320 with m_o = 64 in blocks of
    # 128, and no outliers with a partial last word
    for dtype, m, mo, k, group in (
        ("float16", 256, 256, 8, 32),
        ("bfloat16", 320, 64, 8, 128),
        ("float32", 100, 0, 0, 1),
    ):
        nt = mx.bfloat16 if dtype == "bfloat16" else mx.float16
        idx = ArgInfo("int32", 2, 1 << 16) if k else ArgInfo("int32", 1, 1)
        infos = [ArgInfo(dtype, 2, 1 << 20), ArgInfo("float16", 2, 1 << 16), idx]
        tmpl = [("D", 128), ("M", m), ("MO", mo), ("K", k), ("GROUP", group), ("NT", nt)]
        out.append((ek.SKETCH_ENCODE, infos, ["uint32", nt, "uint32", nt], tmpl))
    return out


@needs_gxx
def test_metal_instantiations_compile_through_the_shim(tmp_path):
    units = []
    for spec, infos, outs, tmpl in _decode_variants():
        src, name = metal_source(spec, infos, outs, tmpl)
        assert f"[[kernel]] void {name}(" in src
        units.append(src)
    compile_metal(units, tmp_path)


@needs_gxx
def test_the_shim_catches_a_broken_body(tmp_path):
    spec = kmerge.MERGE
    src, _ = metal_source(spec, [ArgInfo("float32", 5, 1 << 20)] * 2, ["float32"] * 3)
    broken = src.replace("vx_exp2(ml_part[r * 2] - top)", "vx_exp2(ml_part[r * 2] - tpo)")
    cpp = tmp_path / "broken.cpp"
    cpp.write_text('#include "metal_shim.h"\n' + broken)
    res = subprocess.run(
        [GXX, "-std=c++17", "-fsyntax-only", "-w", "-I", str(shim_dir()), str(cpp)],
        capture_output=True,
        text=True,
        check=False,
    )
    assert res.returncode != 0 and "tpo" in res.stderr


def _mma_codes(bits: int, group, dtype=mx.float16, t: int = 256, dim: int = 128) -> krec.CodeRecord:
    """An affine side's shape for the launch plan; ``group`` 0: a codebook side (one norm a
    token, ``2**bits`` levels) of head dim 128, -1: one with symmetric levels; ``"c32"``:
    per-channel keys (KIVI's) in groups of 32 tokens, ``t`` tokens of ``dim`` channels."""
    if isinstance(group, str):
        g = int(group[1:])
        codes = mx.zeros((1, 1, t, dim * bits // 32), mx.uint32)
        rows = mx.zeros((1, 1, t // g, dim), dtype)
        return krec.ChannelAffineCodes(bits=bits, group=g, codes=codes, scale=rows, zero=rows)
    if group <= 0:
        lev = mx.zeros((1 << bits,), mx.float32)
        norm = mx.zeros((1, 1, 1), dtype)
        u32 = mx.zeros((1,), mx.uint32)
        return krec.CodebookCodes(
            bits=bits, dim=128, codes=u32, norm=norm, levels=lev, symmetric=group < 0
        )
    z = mx.zeros((1,), dtype)
    return krec.AffineCodes(
        bits=bits, group=group, codes=mx.zeros((1,), mx.uint32), scale=z, zero=z
    )


def _mma_variants():
    """The tensor-core kernel as the host builds it (register cap, weights' residual and
    pipeline as the defaults set them), float32 and float16 queries."""
    out = []
    cfg = kcfg.kernel_config()
    bf = ("bfloat16", 4, 1 << 20)
    for kb, vb, m, kg, vg, nw, sub, qd, merged, *sdt in (
        (4, 4, 4, 64, 64, 4, 1, F32, None),
        (4, 4, 4, 64, 64, 4, 1, H16, None),
        (2, 2, 4, 64, 64, 4, 1, H16, None),
        (8, 8, 4, 64, 64, 4, 1, H16, None),
        (4, 4, 4, 64, 64, 2, 2, F32, None),
        (2, 2, 4, 64, 64, 4, 2, H16, "float16"),
        (8, 8, 4, 64, 64, 2, 2, F32, "float32"),
        (4, 4, 8, 32, 32, 4, 2, F32, "bfloat16"),
        (4, 2, 1, 128, 16, 4, 1, F32, None),
        # bfloat16 scales (a bfloat16 model's cache): both sides merged, and on the keys alone
        (4, 4, 4, 64, 64, 4, 2, bf, "bfloat16", bf, bf),
        (2, 4, 4, 64, 64, 4, 1, bf, None, bf, H16),
        # codebook codes (group 0: TurboQuant_mse's levels and norms; -1: symmetric levels,
        # half-table lookups), both sides or one
        (4, 4, 4, -1, -1, 4, 2, H16, None),
        (2, 2, 4, -1, 0, 4, 2, bf, "bfloat16", bf, bf),
        (4, 4, 8, 0, 64, 4, 2, F32, None),
        # per-channel keys (KIVI's: "c32", groups of 32 tokens), as the plan takes them
        (2, 2, 4, "c32", 32, 4, 2, H16, None),
        (2, 2, 1, "c64", 32, 4, 4, bf, "bfloat16", bf, bf),
        (4, 4, 8, "c128", 64, 4, 2, F32, None),
    ):
        ks, vs = sdt or (H16, H16)
        k = _mma_codes(kb, kg, getattr(mx, ks[0]))
        v = _mma_codes(vb, vg, getattr(mx, vs[0]))
        assert kmma.mma_supported(m, 128, k, v)
        stages = kmsup.mma_stages(
            128, k, v, nw, sub, getattr(mx, qd[0]) not in kmsup.MMA_HALF_QUERY
        )
        assert stages >= 2
        tmpl = kmsup.mma_template(
            128,
            k,
            v,
            m,
            nw,
            stages,
            sub,
            None,
            getattr(mx, qd[0]),
            cfg.p_residual,
            cfg.pipeline,
            cfg.value_fold,
            getattr(mx, merged) if merged else None,
            key_fold=cfg.key_fold,
            ldsm=cfg.ldsm,
        )
        infos = [ArgInfo(*qd), *[ArgInfo(*a) for a in (U32, ks, ks, U32, vs, vs)]]
        infos += [ArgInfo("float32", 1, 16)] * 2  # the levels (dummies for affine sides)
        spec = kmsup.mma_spec(
            nw, kmsup.mma_sm_blocks(nw), merged is None
        )  # as _mma_plan pairs them
        out.append((spec, infos, ["float32"] * len(spec.outputs), tmpl))
    return out


def test_mma_kernel_takes_only_the_shapes_it_lays_out():
    ok = kmma.mma_supported
    assert ok(4, 128, _mma_codes(4, 64), _mma_codes(4, 64))
    assert ok(8, 128, _mma_codes(2, 64), _mma_codes(8, 32))
    assert not ok(9, 128, _mma_codes(4, 64), _mma_codes(4, 64))  # more rows than a tile holds
    assert not ok(4, 128, _mma_codes(3, 32), _mma_codes(4, 64))  # 3-bit codes straddle words
    assert ok(4, 128, _mma_codes(4, 64, mx.bfloat16), _mma_codes(4, 64))  # bf16 scales, one side
    assert not ok(4, 128, _mma_codes(4, 64, mx.float32), _mma_codes(4, 64))  # fp16 or bf16 only
    z16, zb = mx.zeros((1,), mx.float16), mx.zeros((1,), mx.bfloat16)
    mixed = krec.AffineCodes(bits=4, group=64, codes=mx.zeros((1,), mx.uint32), scale=zb, zero=z16)
    assert not ok(4, 128, mixed, _mma_codes(4, 64))  # scales and zeros of one dtype a side
    assert not ok(4, 128, _mma_codes(4, 4), _mma_codes(4, 64))  # a word spans two groups
    assert not ok(4, 64, _mma_codes(4, 64), _mma_codes(2, 64))  # 8 value channels of 2 bits
    assert not ok(4, 72, _mma_codes(4, 8), _mma_codes(4, 8))  # head dim not a multiple of 16
    assert ok(4, 128, _mma_codes(4, 0), _mma_codes(2, 0))  # codebook codes, 2 and 4 bits
    assert ok(8, 128, _mma_codes(2, 64), _mma_codes(4, 0, mx.bfloat16))
    lev = mx.zeros((16,), mx.float32)
    norm = mx.zeros((1, 1, 1), mx.float16)
    u32 = mx.zeros((1,), mx.uint32)

    def cb(bits, dim, levels, **kw):
        return krec.CodebookCodes(bits=bits, dim=dim, codes=u32, norm=norm, levels=levels, **kw)

    assert not ok(4, 128, cb(3, 128, lev[:8]), _mma_codes(4, 0))
    assert not ok(4, 128, cb(4, 128, lev[:8]), _mma_codes(4, 0))
    with pytest.raises(ValueError, match="levels is required"):  # no record without levels
        cb(4, 128, None)
    prod = cb(4, 128, lev, signs=u32, rnorm=norm)
    assert not ok(4, 128, prod, _mma_codes(4, 0))  # a residual sketch (TurboQuant_prod)
    assert not ok(4, 64, _mma_codes(4, 64), cb(2, 64, lev[:4]))


def test_symmetric_levels_are_found_on_the_host_and_vouched_for_codebooks_only(monkeypatch):
    """``levels_symmetric`` holds for Lloyd-Max levels (symmetric laws) and fails for a level
    that differs from its mirror after rounding to fp16; ``CodebookCodes.symmetric`` picks the
    symmetric lookups of codebook codes only (unless ``VELOX_DECODE_SYMMETRIC=0``), and is
    refused on affine codes (they have no such field)."""
    from velox_core.ops.lloyd_max import lloyd_max_gaussian

    for bits in (2, 4):
        assert klayout.levels_symmetric(lloyd_max_gaussian(bits).centroids)
    lev = lloyd_max_gaussian(4).centroids.copy()
    lev[3] *= np.float32(1 + 1e-5)  # a float32 change that fp16 rounds away
    assert klayout.levels_symmetric(lev)
    lev[3] *= np.float32(1.01)
    assert not klayout.levels_symmetric(lev)
    assert not klayout.levels_symmetric(np.arange(16, dtype=np.float32))
    assert not klayout.levels_symmetric(np.array([-1.0, -3.0, 3.0, 1.0], np.float32))  # unsorted
    assert not klayout.levels_symmetric(np.array([-1e5, -1.0, 1.0, 1e5], np.float32))  # fp16 inf
    cb4 = dataclasses.replace(_mma_codes(4, 0), symmetric=True)
    cb2 = dataclasses.replace(_mma_codes(2, 0), symmetric=True)
    modes = [kmsup.codebook_mode(c) for c in (_mma_codes(4, 64), _mma_codes(4, 0), cb4, cb2)]
    assert modes == [0, 1, 2, 2]
    kernel_env(monkeypatch, "VELOX_DECODE_SYMMETRIC", "0")  # general lookups, for comparison
    assert [kmsup.codebook_mode(c) for c in (cb4, cb2)] == [1, 1]
    with pytest.raises(ValueError, match="VELOX_DECODE_SYMMETRIC"):
        kernel_env(monkeypatch, "VELOX_DECODE_SYMMETRIC", "2")
    kernel_env(monkeypatch, "VELOX_DECODE_SYMMETRIC", None)
    k = mx.zeros((1, 1, 8, 16), mx.uint32)
    s = mx.ones((1, 1, 8, 2), mx.float16)
    with pytest.raises(TypeError, match="symmetric"):
        krec.AffineCodes(bits=4, group=64, codes=k, scale=s, zero=s, symmetric=True)
    good = krec.AffineCodes(bits=4, group=64, codes=k, scale=s, zero=s)
    assert good.symmetric is False
    with pytest.raises(AttributeError):
        good.symmetric = True


def test_kernel_config_is_read_once_and_typed(monkeypatch):
    """The configuration comes from the environment when first used, then stays (no read on
    the hot path); configure / configured replace it; bad values are refused naming the
    setting, bad fields naming the field."""
    from velox_core.kernels import config

    monkeypatch.setattr(config, "_CURRENT", [])
    monkeypatch.setenv("VELOX_DECODE_MMA_WARPS", "8")
    monkeypatch.setenv("VELOX_KERNELS", "off")
    cfg = kcfg.kernel_config()
    assert cfg.mma_warps == 8 and not cfg.enabled and kcfg.kernel_config().mma_warps == 8
    monkeypatch.setenv("VELOX_DECODE_MMA_WARPS", "2")  # read once: a later write changes nothing
    assert kcfg.kernel_config() is cfg and kcfg.kernel_config().mma_warps == 8
    with kcfg.configured(mma_warps=1, enabled=True):
        assert kcfg.kernel_config().mma_warps == 1 and vk.kernels_enabled()
    assert kcfg.kernel_config() is cfg
    old = kcfg.configure(config.KernelConfig.from_environ())
    assert old is cfg and kcfg.kernel_config().mma_warps == 2
    with pytest.raises(ValueError, match="VELOX_DECODE_MMA_WARPS must be one of 1, 2, 4, 8"):
        config.KernelConfig.from_environ({"VELOX_DECODE_MMA_WARPS": "3"})
    with pytest.raises(ValueError, match="VELOX_DECODE_STAGES must be an integer"):
        config.KernelConfig.from_environ({"VELOX_DECODE_STAGES": "many"})
    with pytest.raises(ValueError, match="KernelConfig.subtiles must be one of 1, 2, 4"):
        config.KernelConfig(subtiles=3)
    with pytest.raises(TypeError, match="KernelConfig.pipeline must be True or False"):
        config.KernelConfig(pipeline=1)
    off = config.KernelConfig.from_environ({"VELOX_LAYOUTS_OFF": " vq, table ,"}).layouts_off
    assert off == frozenset({"vq", "table"})
    with pytest.raises(TypeError, match="KernelConfig.layouts_off must be a frozenset"):
        config.KernelConfig(layouts_off={"vq"})
    with pytest.raises(ValueError, match="VELOX_LAYOUTS_OFF must be a frozenset of layout names"):
        config.KernelConfig.from_environ({"VELOX_LAYOUTS_OFF": "v-q"})
    with pytest.raises(TypeError):
        kcfg.configure(no_such_setting=1)


def test_a_layout_turned_off_takes_the_reference_path(monkeypatch):
    """``KernelConfig.layouts_off`` (``VELOX_LAYOUTS_OFF``) declines a layout's segments in
    the dispatcher, keys or values, and leaves the others to the kernels."""
    monkeypatch.setattr(vk, "backend", lambda: "metal")
    b, h, t, d = 1, 2, 64, 128
    side = krec.AffineCodes(
        bits=4,
        group=64,
        codes=mx.zeros((b, h, t, d * 4 // 32), mx.uint32),
        scale=mx.ones((b, h, t, 2)),
        zero=mx.zeros((b, h, t, 2)),
    )
    shape = (b, h, 4, d)
    assert dk.plan_decode(shape, mx.float32, side, side) is not None
    with kcfg.configured(layouts_off=frozenset({"affine"})):
        assert dk.plan_decode(shape, mx.float32, side, side) is None
    with kcfg.configured(layouts_off=frozenset({"codebook", "vq"})):
        assert dk.plan_decode(shape, mx.float32, side, side) is not None


def test_query_factor_is_log2e_times_the_scale():
    import struct

    for scale in (None, 1 / math.sqrt(128), 0.5):
        got = struct.unpack("<f", struct.pack("<i", klayout.qmul_bits(scale)))[0]
        assert got == pytest.approx(klayout.LOG2E * (1.0 if scale is None else scale), rel=1e-7)


def test_mma_launch_settings():
    k, v = _mma_codes(4, 64), _mma_codes(4, 64)
    assert kmsup.mma_stages(128, k, v, 4) == 4  # 4 x 4 x 2,304 B fits in 48 KiB
    assert kmsup.mma_stages(128, _mma_codes(8, 64), _mma_codes(8, 64), 4) == 2
    assert kmsup.mma_stages(128, _mma_codes(8, 64), _mma_codes(8, 64), 8) == 0
    assert kmsup.mma_stages(128, k, v, 4, 2) == 2  # 32-token steps: twice the bytes per stage
    assert kmsup.mma_stages(128, _mma_codes(8, 64), _mma_codes(8, 64), 4, 2) == 0
    for t, rows in ((131072, 8), (4096, 8), (1, 1), (600, 64)):
        s = kmma.mma_splits(t, rows, 4)
        span = -(-t // s)
        assert 1 <= s <= t and (s == 1 or span >= kmma.MMA_MIN_SPAN)


def test_fused_merge_follows_the_context_unless_set(monkeypatch):
    """The decode kernel merges its own splits up to MMA_FUSE_TOKENS tokens (a launch saved),
    a second launch past them (no fill of the partials); VELOX_DECODE_FUSE 0 / 1 decides."""
    kernel_env(monkeypatch, "VELOX_DECODE_FUSE", None)
    assert kmma.mma_fuse_merge(kmma.MMA_FUSE_TOKENS) and not kmma.mma_fuse_merge(
        kmma.MMA_FUSE_TOKENS + 1
    )
    kernel_env(monkeypatch, "VELOX_DECODE_FUSE", "1")
    assert kmma.mma_fuse_merge(131072)
    kernel_env(monkeypatch, "VELOX_DECODE_FUSE", "0")
    assert not kmma.mma_fuse_merge(16)
    with pytest.raises(ValueError, match="VELOX_DECODE_FUSE must be 0 or 1"):
        kernel_env(monkeypatch, "VELOX_DECODE_FUSE", "auto")


def test_sources_take_one_dtype_per_output():
    """The CUDA and Metal sources (MLX's generators' twins) want one dtype per declared output,
    as an MLX launch does: the two-output tensor-core kernel with one dtype is an error."""
    infos = [ArgInfo("float16", 4, 1 << 20)] + [ArgInfo("uint32", 4, 1 << 20)] * 6
    parts = kmsup.mma_spec(4, 3, parts=True)
    with pytest.raises(ValueError, match="1 output dtypes for the outputs"):
        cuda_source(parts, infos, ["float32"])
    with pytest.raises(ValueError, match="2 output dtypes"):
        metal_source(kmerge.MERGE, infos[:2], ["float32", "float32"])


def test_decode_attention_merges_in_the_kernel_up_to_the_fuse_limit(monkeypatch):
    """decode_attention without fp16 segments on the CUDA path asks the tensor-core kernel to
    merge its own splits (an out_dtype) up to MMA_FUSE_TOKENS coded tokens, for the partials
    past them (no out_dtype: the separate merge)."""

    class Routed(Exception):
        pass

    def fake(q_shape, q_dtype, keys, values, splits, scale, out_dtype=None, *where):
        raise Routed(out_dtype)

    kernel_env(monkeypatch, "VELOX_DECODE_FUSE", None)
    monkeypatch.setattr(dk._kernels, "backend", lambda: "cuda")
    monkeypatch.setattr(dk, "plan_mma", fake)
    q = mx.zeros((1, 1, 4, 128), mx.float16)
    for t, want in ((kmma.MMA_FUSE_TOKENS, mx.float16), (kmma.MMA_FUSE_TOKENS + 1, None)):
        z = mx.zeros((1, 1, t, 2), mx.float16)
        c = krec.AffineCodes(
            bits=4, group=64, codes=mx.zeros((1, 1, t, 16), mx.uint32), scale=z, zero=z
        )
        with pytest.raises(Routed) as got:
            dk.decode_attention(q, c, c, fp16=[], out_dtype=mx.float16)
        assert got.value.args[0] == want, t


def test_value_fold_takes_only_the_layouts_it_covers(monkeypatch):
    """VFOLD: groups of 8 whole interleaved units (16-bit units with LDSM; else words at 4
    and 8 bits, bytes at 2), at most four groups a token, weights rounded to fp16; the
    settings are 0/1 flags and the template constants follow them."""
    ok = kmsup.mma_fold_ok
    for ldsm in (False, True):
        assert ok(_mma_codes(4, 64), 128, False, ldsm) and ok(_mma_codes(4, 128), 128, False, ldsm)
        assert ok(_mma_codes(8, 64), 128, False, ldsm) and ok(_mma_codes(8, 32), 128, False, ldsm)
        assert ok(_mma_codes(2, 64), 128, False, ldsm) and ok(_mma_codes(2, 32), 128, False, ldsm)
        assert not ok(_mma_codes(4, 64), 128, True, ldsm)  # the weights' residual MMA
        assert not ok(_mma_codes(2, 16), 128, False, ldsm)  # 4 bytes, 2 units
        assert not ok(_mma_codes(8, 32), 256, False, ldsm)  # eight groups a token
    assert not ok(_mma_codes(4, 32), 128, False, False)  # a group of 4 words
    assert ok(_mma_codes(4, 32), 128, False, True)  # ... and of 8 16-bit units
    assert not ok(_mma_codes(8, 16), 64, False, False) and ok(_mma_codes(8, 16), 64, False, True)
    units = kmsup.mma_value_units
    assert [units(_mma_codes(b, 64), True) for b in (2, 4, 8)] == [8, 4, 2]
    assert [units(_mma_codes(b, 64), False) for b in (2, 4, 8)] == [4, 8, 4]
    assert units(_mma_codes(2, 32), True) == 4  # 2 bits, 32 channels a group: bytes
    kernel_env(monkeypatch, "VELOX_DECODE_LDSM", "0")
    assert kcfg.kernel_config().ldsm is False
    with pytest.raises(ValueError, match="VELOX_DECODE_LDSM must be 0 or 1"):
        kernel_env(monkeypatch, "VELOX_DECODE_LDSM", "on")
    kernel_env(monkeypatch, "VELOX_DECODE_LDSM", None)
    k = v = _mma_codes(4, 64)
    fold = dict(kmsup.mma_template(128, k, v, 4, 4, 2, 2, None, mx.float16, False, True, True))
    assert fold["VFOLD"] == 1
    assert (
        dict(kmsup.mma_template(128, k, v, 4, 4, 2, 2, None, mx.float16, True, False, True))[
            "VFOLD"
        ]
        == 0
    )
    kernel_env(monkeypatch, "VELOX_DECODE_VFOLD", "0")
    assert kcfg.kernel_config().value_fold is False
    with pytest.raises(ValueError, match="VELOX_DECODE_VFOLD must be 0 or 1"):
        kernel_env(monkeypatch, "VELOX_DECODE_VFOLD", "yes")


def test_key_fold_takes_only_the_layouts_it_covers(monkeypatch):
    """KFOLD: groups of 4 whole key words (the four lanes of a k-step), at most two groups a
    token; the setting is a 0/1 flag and its template constant follows it."""
    ok = kmsup.mma_key_fold_ok
    assert ok(_mma_codes(2, 64), 128) and ok(_mma_codes(4, 32), 64) and ok(_mma_codes(8, 16), 32)
    assert ok(_mma_codes(4, 128), 128) and ok(_mma_codes(8, 64), 128)
    assert not ok(_mma_codes(2, 32), 128)  # 2 words a group: a k-step spans two
    assert not ok(_mma_codes(4, 16), 128)
    assert not ok(_mma_codes(4, 32), 128)  # four groups a token
    k = _mma_codes(2, 64)
    args = (128, k, k, 4, 4, 2, 4, None, mx.float16, False, True, True)
    assert dict(kmsup.mma_template(*args, key_fold=True))["KFOLD"] == 1
    assert dict(kmsup.mma_template(*args))["KFOLD"] == 0
    k32 = _mma_codes(4, 32)
    assert dict(kmsup.mma_template(128, k32, k, 4, 4, 2, 2, key_fold=True))["KFOLD"] == 0
    kernel_env(monkeypatch, "VELOX_DECODE_KFOLD", "0")
    assert kcfg.kernel_config().key_fold is False
    with pytest.raises(ValueError, match="VELOX_DECODE_KFOLD must be 0 or 1"):
        kernel_env(monkeypatch, "VELOX_DECODE_KFOLD", "2")


def test_mma_splits_fill_whole_waves_of_the_sms(monkeypatch):
    """With the SM count known, the split count fills whole waves of threadgroups (a partial
    last wave costs nearly a full one): at 132 SMs and 3 threadgroups per SM, 8 KV heads take
    49 splits (392 of 396 slots), 64 take 6 (384); the busiest SM's share of the context is
    never more than with the block target."""
    assert kmma.sm_count() is None  # the CPU: no CUDA device
    kernel_env(monkeypatch, "VELOX_DECODE_SMS", "132")
    assert kmma.sm_count() == 132
    assert kmma.mma_splits(131072, 8, 4, 3) == 49
    assert kmma.mma_splits(131072, 64, 4, 3) == 6
    assert kmma.mma_splits(16384, 8, 4, 3) == 32  # at least MMA_MIN_SPAN tokens per split
    slots = 132 * 3
    for t, rows in ((131072, 8), (65536, 16), (131072, 64), (40000, 24), (700, 2)):
        s = kmma.mma_splits(t, rows, 4, 3)
        assert 1 <= s <= t and (s == 1 or -(-t // s) >= kmma.MMA_MIN_SPAN)
        kernel_env(monkeypatch, "VELOX_DECODE_BLOCKS", str(kmma.MMA_BLOCKS))
        old = kmma.mma_splits(t, rows, 4, 3)
        kernel_env(monkeypatch, "VELOX_DECODE_BLOCKS", None)
        assert -(-rows * s // slots) * -(-t // s) <= -(-rows * old // slots) * -(-t // old)
    with pytest.raises(ValueError, match="VELOX_DECODE_SMS"):
        kernel_env(monkeypatch, "VELOX_DECODE_SMS", "0")


@needs_nvcc
def test_tensor_core_instantiations_compile_within_their_register_cap(tmp_path):
    """The CUDA-only tensor-core decode kernel compiles for sm_90a under the register cap its
    host code declares (``__launch_bounds__``: 168 registers for 12 warps per SM), spilling at
    most a few words (32 bytes: the cap trades them for a third threadgroup per SM, measured
    faster on an H200), and fits the static shared memory its host code assumes (48 KiB)."""
    log = compile_cuda([[cuda_source(*v)[0]] for v in _mma_variants()], tmp_path, spill_bytes=32)
    smem = [int(x) for x in re.findall(r"(\d+) bytes smem", log)]
    assert smem and max(smem) <= 48 * 1024, smem
    regs = [int(x) for x in re.findall(r"Used (\d+) registers", log)]
    capped = [v[0].cuda_launch_bounds for v in _mma_variants()]
    for r, lb in zip(regs, capped):
        if lb is not None:
            assert r <= 65536 // (lb[0] * lb[1]), (r, lb)


@needs_nvcc
def test_cuda_instantiations_compile_without_spills(tmp_path):
    """nvcc compiles the CUDA instantiations for sm_90a (H100/H200) down to machine code.

    Against MLX's real device headers when ``VELOX_MLX_CUDA_INCLUDE`` names them (the
    ``include`` folder holding ``mlx/backend/cuda/device/utils.cuh``), else the stand-in in
    ``metal/shim/cuda``."""
    probe = cuda_source(kmsup.PROBE_SUBNORMAL, [ArgInfo("uint32", 1, 1)], ["float32"], [])[0]
    variants = _decode_variants()
    plain = [cuda_source(*v)[0] for v in variants if v[0].cuda_launch_bounds is None]
    # a unit with launch bounds re-defines __global__ for the rest of its translation unit
    bounded = [cuda_source(*v)[0] for v in variants if v[0].cuda_launch_bounds is not None]
    # the plain kernels in one unit, the bounded ones each in their own, compiled alongside
    compile_cuda([[*plain, probe], *([u] for u in bounded)], tmp_path)


# -- emulation: the Metal instantiation run on the CPU --------------------------------------------

DECODE_CASES = {
    # name: (B, H, T, M, bits, group, scale dtype, splits, pad)
    "4bit-splits": (1, 2, 150, 4, 4, 64, mx.float16, 3, 0),
    "2bit-b2-strided": (2, 1, 77, 4, 2, 64, mx.float16, None, 5),
    "8bit-mha-bf16": (1, 1, 300, 1, 8, 64, mx.bfloat16, 2, 0),
    "4bit-pad-rows-g8": (1, 1, 64, 6, 4, 8, mx.float16, None, 0),
    "3bit-two-blocks": (1, 1, 100, 4, 3, 32, mx.float16, None, 3),
    "4bit-gqa8-odd": (1, 1, 91, 8, 4, 64, mx.float32, 2, 0),
    "6bit-one-token": (1, 2, 1, 4, 6, 64, mx.float16, None, 2),
}


def _module_emulator(tmp_path_factory, tag: str, cls=Emulator):
    """An emulator program ``cls`` for a module fixture, working in a fresh folder named
    after ``tag``; the tests using it are skipped without g++."""
    if GXX is None:
        pytest.skip("g++ is not installed: the kernels cannot be emulated here")
    return cls(tmp_path_factory.mktemp(tag))


@pytest.fixture(scope="module")
def emulated(tmp_path_factory):
    emu = _module_emulator(tmp_path_factory, "emu")
    cases = {}
    for name, (b, h, t, m, bits, group, dt, splits, pad) in DECODE_CASES.items():
        q, keys, vals, ref = uniform_case(b, h, t, m, bits, group, dt, seed=len(cases))
        run = DecodeRun(emu, q, keys, vals, splits=splits, pad=pad)
        cases[name] = (_Memo(run), ref, q, keys, vals)
    return emu, cases


class _Memo:
    """A DecodeRun whose result is computed once (emulation is slow)."""

    def __init__(self, run):
        self.run, self.out = run, None

    def __getattr__(self, name):
        return getattr(self.run, name)

    def __call__(self):
        if self.out is None:
            self.out = self.run()
        return self.out


@pytest.mark.parametrize("name", list(DECODE_CASES))
def test_decode_kernel_matches_the_reference_partial(emulated, name):
    _, cases = emulated
    run, ref, *_ = cases[name]
    assert_partial_close(run(), ref)


@needs_gxx
@pytest.mark.parametrize("m,bits,pad", [(4, 3, 3), (3, 5, 0)])
def test_decode_kernel_takes_four_rows_a_pass_at_32_channels_a_lane(
    monkeypatch, tmp_path, m, bits, pad
):
    """The layout CUDA plans for lanes of 32 channels (4 query rows a pass, 128 query
    values a lane), run through the emulator against the reference partial."""
    q, keys, vals, ref = uniform_case(1, 2, 300, m, bits, 32, mx.float16, seed=5)
    monkeypatch.setattr(vk, "backend", lambda: "cuda")  # the plan CUDA takes
    run = DecodeRun(Emulator(tmp_path), q, keys, vals, splits=2, pad=pad)
    assert (run.plan.cpl, run.plan.mb, run.plan.nmb) == (32, 4, 1)
    assert_partial_close(run(), ref)


@needs_gxx
@pytest.mark.parametrize("m,pad", [(4, 0), (3, 5)])
def test_decode_kernel_adds_the_keys_residual_sketch(tmp_path, m, pad):
    """Codebook keys with a 1-bit residual sketch (TurboQuant_prod's layout): the kernel's
    scores are norm * (q . levels[c] + rnorm * (qs . (2 bits - 1))), against a numpy
    reference built from the same codes, signs and norms (strided slices with garbage
    beyond when ``pad``); dropping the sketch term or its sign makes it fail."""
    from velox_core.ops import pack

    rng = np.random.default_rng(m)
    b, h, t, d, bits = 1, 2, 300, 128, 2
    levels = mx.array(np.sort(rng.standard_normal(1 << bits)).astype(np.float32) * 0.1)
    codes = rng.integers(0, 1 << bits, size=(b, h, t, d))
    signs = rng.integers(0, 2, size=(b, h, t, d))
    norm = (rng.random((b, h, t)) + 0.5).astype(np.float16)
    rnorm = (rng.random((b, h, t)) * 0.3).astype(np.float16)
    vcodes = rng.integers(0, 1 << bits, size=(b, h, t, d))
    vnorm = (rng.random((b, h, t)) + 0.5).astype(np.float16)
    keys = krec.CodebookCodes(
        bits=bits,
        dim=d,
        codes=pack(mx.array(codes), bits),
        norm=mx.array(norm),
        levels=levels,
        signs=pack(mx.array(signs), 1),
        rnorm=mx.array(rnorm),
    )
    vals = krec.CodebookCodes(
        bits=bits, dim=d, codes=pack(mx.array(vcodes), bits), norm=mx.array(vnorm), levels=levels
    )
    q = mx.array(rng.standard_normal((b, h, m, d)).astype(np.float32) * 0.5)
    qs = mx.array(rng.standard_normal((b, h, m, d)).astype(np.float32) * 0.05)
    emu = Emulator(tmp_path)
    got = DecodeRun(emu, q, keys, vals, splits=3, pad=pad, q_sketch=qs)()
    lv = np.asarray(levels)
    kx = lv[codes]  # (B, H, T, D)
    sgn = signs * 2.0 - 1.0
    qn, qsn = np.asarray(q), np.asarray(qs)
    s = np.einsum("bhmd,bhtd->bhmt", qn, kx) + rnorm.astype(np.float32)[:, :, None, :] * np.einsum(
        "bhmd,bhtd->bhmt", qsn, sgn
    )
    s = s * norm.astype(np.float32)[:, :, None, :]
    vx = lv[vcodes] * vnorm.astype(np.float32)[..., None]
    mref = s.max(axis=-1, keepdims=True)
    p = np.exp(s - mref)
    ref = (p @ vx, mref, p.sum(axis=-1, keepdims=True))
    assert_partial_close(got, ref, tol=5e-5)


@needs_gxx
@pytest.mark.parametrize("bits,group,pad", [(4, 32, 0), (2, 64, 7)])
def test_decode_kernel_reads_per_channel_keys(tmp_path, bits, group, pad):
    """KIVI's keys: per-channel scales and zeros for each group of tokens (the portable
    kernel decodes each code with its channel's scale and zero), per-token values; against
    the codecs' reference partial, strided with garbage rows beyond when ``pad``."""
    k, v = kv_data(h=2, t=8 * group, seed=bits)
    kc, vc = Uniform(bits, group=group, axis="channel"), Uniform(bits, group=64)
    kp, vp = kc.encode(k), vc.encode(v)
    keys, vals = kc.kernel_codes(kp), vc.kernel_codes(vp)  # ChannelAffineCodes, AffineCodes
    q = mx.random.normal((1, 2, 4, 128), key=mx.random.key(bits)) * 0.3
    got = DecodeRun(Emulator(tmp_path), q, keys, vals, splits=3, pad=pad)()
    ref = partial(q, Segment(kc, kp, vc, vp))
    assert_partial_close(got, ref, tol=5e-5)


@needs_gxx
def test_kivi_style_cache_on_an_emulated_gpu_takes_the_kernel(monkeypatch, tmp_path):
    """A UniformCache with per-channel keys (KIVI's layout) and an fp16 window, attended with
    the backend reported as Metal: its coded body goes through the decode kernel and the
    fp16 merge, and matches the reference path."""
    k, v = kv_data(t=300, dtype=mx.bfloat16)
    q = mx.random.normal((1, 4, 1, 128), key=mx.random.key(4)).astype(mx.bfloat16)
    cache = UniformCache(bits=4, group=32, key_axis="channel", window=16, sinks=4)
    cache.update_and_fetch(k, v)  # encoded on the CPU path
    ref = cache.attend(q, 0.088)
    fake = EmulatedKernels(tmp_path).install(monkeypatch)
    got = cache.attend(q, 0.088)
    assert fake.names == ["velox_decode_attention", "velox_decode_merge_fp16"]
    err = np.abs(np.asarray((got - ref).astype(mx.float32))).max()
    assert err < 2e-2 * np.abs(np.asarray(ref.astype(mx.float32))).max()


def test_decode_kernel_partials_merge_with_other_segments(emulated):
    """The kernel's partial joins fp16 segments in one softmax (merge_partials format)."""
    _, cases = emulated
    run, _, q, keys, vals = cases["4bit-splits"]
    o, m, l = (mx.array(x) for x in run())
    b, h, mm, d = o.shape
    win_k = mx.random.normal((b, h, 9, d), key=mx.random.key(11)).astype(mx.float16)
    win_v = mx.random.normal((b, h, 9, d), key=mx.random.key(12)).astype(mx.float16)
    ident = Identity()
    seg = Segment(ident, ident.encode(win_k), ident, ident.encode(win_v))
    got = merge_partials([(o, m, l), partial(q, seg)])
    kc = Uniform(4)
    body = Segment(kc, _packed(keys), kc, _packed(vals))
    want = merge_partials([partial(q, body), partial(q, seg)])
    assert np.abs(np.asarray(got - want)).max() < 1e-4
    # and it is plain softmax attention over the decoded tokens
    full = attend(q.reshape(b, h * mm, 1, d), [body, seg], 1.0).reshape(b, h, mm, d)
    assert np.abs(np.asarray(got - full)).max() < 1e-4


def _packed(side):
    from velox_core import Packed

    return Packed(
        {"codes": side.codes, "scale": side.scale, "zero": side.zero}, side.codes.shape[2]
    )


def test_split_partials_are_split_local(emulated):
    """Each split's (max, sum) describes its own tokens only: the last split of an uneven
    context holds fewer tokens, and every split is non-empty."""
    _, cases = emulated
    run, *_ = cases["4bit-gqa8-odd"]
    _, ml = run.partials()
    assert run.s == 2 and np.all(ml[..., 1] >= 1.0 - 1e-6)  # each sum includes its max's term


_WIDTHS = ((2, 64), (3, 32), (4, 64), (5, 128), (6, 64), (7, 32), (8, 16), (4, 4))
ENCODE_CASES = [
    *((bits, group, mx.float16, clip) for bits, group in _WIDTHS for clip in (1.0, 0.85)),
    (4, 64, mx.bfloat16, 1.0),
    (2, 32, mx.bfloat16, 0.85),
    (8, 128, mx.bfloat16, 1.0),
    (4, 64, mx.float32, 1.0),
    (3, 64, mx.float32, 0.85),
]


@pytest.fixture(scope="module")
def encoders(tmp_path_factory):
    emu = _module_emulator(tmp_path_factory, "emu_enc")
    handles = {}
    for bits, group, dtype, clip in ENCODE_CASES:
        x = _encode_input(dtype)
        sdt = mx.bfloat16 if dtype == mx.bfloat16 else mx.float16
        tmpl = [
            ("BITS", bits),
            ("HD", 128),
            ("GROUP", group),
            ("CLIPB", ek.clip_bits(clip)),
            ("ST", sdt),
        ]
        outs = ["uint32", sdt, sdt]
        handles[(bits, group, dtype, clip)] = emu.kernel(
            ek.AFFINE_ENCODE, [np_input(x.reshape(-1, 128))], outs, tmpl, sequential=True
        )
    return emu, handles


def _encode_input(dtype):
    x = mx.random.normal((2, 3, 7, 128), key=mx.random.key(3)) * 2.0
    x = mx.where(mx.arange(128) % 17 == 0, x * 8.0, x)  # outlier channels
    x[0, 0, 0, :64] = 0.5  # a constant group: scale floors at 1e-8
    return x.astype(dtype)


@pytest.mark.parametrize("bits,group,dtype,clip", ENCODE_CASES)
def test_affine_encode_kernel_is_bit_exact(encoders, bits, group, dtype, clip):
    emu, handles = encoders
    x = _encode_input(dtype)
    rows = x.size // 128
    words = -(-128 * bits // 32)
    codes, scale, zero = emu.run(
        handles[(bits, group, dtype, clip)],
        [np_input(x.reshape(rows, 128))],
        [(rows, words), (rows, 128 // group), (rows, 128 // group)],
        (rows, 1, 1),
        (64, 1, 1),
    )
    rc, rs, rz = affine_quantize(x, bits, group, "token", clip)
    want = np.asarray(pack(rc, bits)).reshape(rows, words)
    assert np.array_equal(codes, want)
    as_bits = (lambda a: np.asarray(a.view(mx.uint16))) if dtype == mx.bfloat16 else np.asarray
    assert np.array_equal(scale, as_bits(rs).reshape(rows, -1))
    assert np.array_equal(zero, as_bits(rz).reshape(rows, -1))


SKETCH_CASES = {
    # name: (m, outliers, m_o, group, x dtype)
    "paper-outliers": (256, 8, 256, 32, mx.float16),
    "m320-ob8": (320, 8, 64, 16, mx.bfloat16),
    "no-outliers": (256, 0, 0, 1, mx.float16),
    "partial-word": (100, 0, 0, 1, mx.bfloat16),
    "partial-both": (100, 3, 15, 8, mx.float32),
}


def _sketch_case(name):
    """x (2, 2, 32, 128) with strong channels, S (R, 128) float16, and per block of ``group``
    tokens sorted distinct outlier channels (int32 ``(2, 2, 32 / group, k)``) or None."""
    m, k, mo, group, dtype = SKETCH_CASES[name]
    rng = np.random.default_rng(len(name))
    b, h, t, d = 2, 2, 32, 128
    x = rng.standard_normal((b, h, t, d)) * np.where(np.arange(d) % 19 == 0, 6.0, 1.0)
    x = mx.array(x.astype(np.float32)).astype(dtype)
    s = mx.array(rng.standard_normal((max(m, mo) + 3, d)).astype(np.float16))
    if not k:
        return x, s, None
    idx = np.stack([np.sort(rng.choice(d, k, replace=False)) for _ in range(b * h * t // group)])
    return x, s, mx.array(idx.reshape(b, h, t // group, k).astype(np.int32))


@pytest.fixture(scope="module")
def sketch_encoders(tmp_path_factory):
    emu = _module_emulator(tmp_path_factory, "emu_sketch")
    handles = {}
    for name, (m, k, mo, group, dtype) in SKETCH_CASES.items():
        x, s, idx = _sketch_case(name)
        nt = ops.scale_dtype(dtype)
        ins = [np_input(x.reshape(-1, 128)), np.asarray(s)]
        ins.append(np.asarray(idx).reshape(-1, k) if k else np.zeros((1,), np.int32))
        tmpl = [("D", 128), ("M", m), ("MO", mo), ("K", k), ("GROUP", group), ("NT", nt)]
        handles[name] = (emu.kernel(ek.SKETCH_ENCODE, ins, ["uint32", nt, "uint32", nt], tmpl), ins)
    return emu, handles


@pytest.mark.parametrize("name", list(SKETCH_CASES))
def test_sketch_encode_kernel_matches_a_float64_reference(sketch_encoders, name):
    """The sketch encode kernel's sign words are those of the exact (float64) ``S x_in`` and
    ``S x_o`` (outlier channels zeroed / kept alone, per block), packed as ``pack(bits, 1)``
    with a partial last word's high bits zero, and its norms are the exact norms rounded to
    the norm dtype (the launch leaves outputs uninitialized: every word must be written).
    Random data has (almost) no ``S x`` within float32 rounding of 0, so the bits are exact;
    the MLX reference (``sign_sketch`` + ``pack``) gives the same words."""
    from velox_core.ops import sign_sketch

    emu, handles = sketch_encoders
    handle, ins = handles[name]
    m, k, mo, group, dtype = SKETCH_CASES[name]
    x, s, idx = _sketch_case(name)
    rows = x.size // 128
    w, wo = -(-m // 32), -(-mo // 32)
    shapes = [(rows, w), (rows,), (rows, wo) if k else (1,), (rows,) if k else (1,)]
    sign, norm, osign, onorm = emu.run(
        handle, ins, shapes, (rows * (w + wo), 1, 1), (ek.THREADS, 1, 1)
    )
    xf = np.asarray(x.astype(mx.float32)).astype(np.float64).reshape(rows, 128)
    sf = np.asarray(s).astype(np.float64)
    mask = np.zeros((rows, 128), bool)
    if k:
        blocks = np.asarray(idx).reshape(-1, k)
        mask[np.arange(rows)[:, None], blocks[np.arange(rows) // group]] = True
    x_in, x_o = np.where(mask, 0.0, xf), np.where(mask, xf, 0.0)

    def as_float(a):
        if dtype == mx.bfloat16:
            return (a.astype(np.uint32) << 16).view(np.float32).astype(np.float64)
        return a.astype(np.float64)

    ulp = 2.0**-7 if dtype == mx.bfloat16 else 2.0**-10  # one unit of the norm's last place
    for part, words, got_sign, got_norm, n in (
        (x_in, w, sign, norm, m),
        *(((x_o, wo, osign, onorm, mo),) if k else ()),
    ):
        sx = part @ sf[:n].T
        # float32 sums of D products are within D * 2^-24 * sum |x_c s_c| of exact; the
        # rows' few entries nearer 0 than that still come out exact on this data
        near = np.abs(sx) <= 128 * 2.0**-24 * (np.abs(part) @ np.abs(sf[:n]).T)
        assert near.mean() < 1e-3
        assert np.array_equal(got_sign, sign_words(sx))
        want = np.linalg.norm(part, axis=-1)
        assert np.all(np.abs(as_float(got_norm) - want) <= ulp * want)
        ref = pack(sign_sketch(mx.array(part.astype(np.float32)), s[:n]), 1)
        assert got_sign.shape == (rows, words) and np.array_equal(got_sign, np.asarray(ref))


# -- the library's own host code, with the kernels emulated ---------------------------------------


@needs_gxx
def test_cache_on_an_emulated_gpu_matches_the_reference(monkeypatch, tmp_path):
    """A UniformCache filled and attended with the backend reported as Metal: encode() and
    attend() go through the library's kernel calls (affine_encode, decode_attention and its
    merge), each run by the emulator; codes equal the CPU cache's bit for bit and attention
    matches the reference path."""
    bits, dtype = 4, mx.bfloat16
    k, v = kv_data(t=300, dtype=dtype)
    q = mx.random.normal((1, 4, 1, 128), key=mx.random.key(9)).astype(dtype)
    ref_cache = UniformCache(bits=bits, window=16, sinks=4)
    ref_cache.update_and_fetch(k[:, :, :290], v[:, :, :290])
    ref_cache.update_and_fetch(k[:, :, 290:], v[:, :, 290:])
    ref = ref_cache.attend(q, 0.088)

    fake = EmulatedKernels(tmp_path).install(monkeypatch)
    cache = UniformCache(bits=bits, window=16, sinks=4)
    cache.update_and_fetch(k[:, :, :290], v[:, :, :290])
    cache.update_and_fetch(k[:, :, 290:], v[:, :, 290:])
    got = cache.attend(q, 0.088)
    names = fake.names
    # keys and values, one flush: the second update's 10 tokens wait in the window (fewer
    # than the flush quantum)
    assert names.count("velox_encode_affine") == 2
    assert names[-2:] == ["velox_decode_attention", "velox_decode_merge_fp16"]  # one softmax
    body, ref_body = cache.segments()[1], ref_cache.segments()[1]
    for name in ("codes", "scale", "zero"):
        assert mx.array_equal(body.keys.data[name], ref_body.keys.data[name]).item()
        assert mx.array_equal(body.values.data[name], ref_body.values.data[name]).item()
    assert (
        got.dtype == ref.dtype and np.abs(np.asarray((got - ref).astype(mx.float32))).max() < 2e-2
    )


# -- the CUDA-only tensor-core kernel, emulated lane by lane --------------------------------------

MMA_CASES = {
    # name: (B, H, T, M, key bits, value bits, key group, value group, warps, subtiles, splits, pad)
    "4bit-two-splits": (1, 2, 100, 4, 4, 4, 64, 64, 4, 1, 2, 0),
    "4bit-b2-steps-of-two-strided": (2, 2, 333, 4, 4, 4, 64, 64, 2, 2, 3, 7),
    "2bit-steps-of-two": (1, 2, 77, 4, 2, 2, 64, 64, 4, 2, 2, 0),
    "8bit-gqa8-g32": (1, 1, 150, 8, 8, 8, 32, 32, 2, 2, 2, 0),
    "k4v2-six-rows": (1, 2, 65, 6, 4, 2, 32, 32, 4, 1, 2, 0),
    "g128-keys-g16-values-odd-planes": (1, 3, 49, 1, 4, 4, 128, 16, 4, 1, 2, 3),
    "one-token": (1, 2, 1, 4, 4, 4, 64, 64, 4, 1, 1, 0),
    "small-groups-k16-v8": (1, 2, 90, 4, 4, 4, 16, 8, 2, 2, 2, 0),
    "4bit-fp16-query": (1, 2, 130, 4, 4, 4, 64, 64, 4, 1, 2, 0),
    "2bit-fp16-query-gqa8-strided": (2, 1, 70, 8, 2, 2, 64, 64, 2, 2, 2, 5),
    "4bit-weights-residual": (1, 2, 130, 4, 4, 4, 64, 64, 4, 1, 2, 0),
    "4bit-no-pipeline": (1, 2, 130, 4, 4, 4, 64, 64, 4, 1, 3, 0),
    "4bit-fp16-query-long-ring": (1, 2, 1500, 4, 4, 4, 64, 64, 4, 1, 1, 0),  # 23 steps a warp
    "4bit-no-folds": (1, 2, 130, 4, 4, 4, 64, 64, 4, 1, 2, 0),
    "8bit-fold-gqa8": (1, 1, 150, 8, 8, 8, 64, 64, 2, 1, 2, 0),
    "k2v4-fold-g128-strided": (1, 2, 200, 4, 2, 4, 64, 128, 4, 1, 2, 3),
    "4bit-fold-g128-fp16-query": (1, 2, 260, 3, 4, 4, 128, 128, 4, 2, 3, 0),
    "mha-many-splits": (1, 1, 700, 1, 4, 4, 64, 64, 4, 1, 40, 0),  # 18 of them empty
    "2bit-steps-of-four": (1, 2, 300, 4, 2, 2, 64, 64, 4, 4, 2, 0),
    "two-rows-merge-in-chunks": (1, 1, 570, 2, 4, 4, 64, 64, 4, 2, 9, 0),  # 64 tokens a split
    "k2v2-g32-values-fp16-query": (1, 2, 200, 4, 2, 2, 128, 32, 4, 4, 2, 0),  # 4 value groups
    "k8v4-g128-keys-five-rows": (1, 2, 150, 5, 8, 4, 128, 64, 2, 1, 2, 0),
    "k4v2-values-one-byte-group": (1, 2, 150, 4, 4, 2, 64, 128, 4, 1, 2, 0),
    "8bit-fold-four-value-groups": (1, 1, 150, 8, 8, 8, 64, 32, 2, 1, 2, 0),
    "hd64-folds": (1, 2, 130, 4, 2, 4, 64, 64, 4, 2, 2, 0),
    "hd256-folds-four-value-groups": (1, 2, 100, 4, 4, 2, 128, 64, 2, 1, 2, 0),
    # folds only the 16-bit-unit layout allows: 4-bit values in groups of 32, 8-bit in 16
    "4bit-g32-values-ldsm-fold": (1, 2, 140, 4, 4, 4, 64, 32, 4, 2, 2, 0),
    "hd64-8bit-g16-values-ldsm-fold": (1, 2, 90, 4, 8, 8, 32, 16, 2, 1, 2, 0),
    # key rows of an odd number of 16-byte segments: an ldmatrix.x2 after the x4 loads
    "hd64-2bit-keys-ldsm": (1, 2, 130, 4, 2, 4, 64, 64, 4, 2, 2, 0),
    "hd96-4bit-keys-three-segments": (1, 2, 100, 4, 4, 8, 96, 48, 4, 1, 2, 0),
    # bfloat16 inputs (a bfloat16 model's cache: bfloat16 scales and zeros, query and output)
    "4bit-bf16-folds-merged": (1, 2, 150, 4, 4, 4, 64, 64, 4, 2, 3, 0),
    "2bit-bf16-no-folds": (1, 2, 130, 4, 2, 2, 64, 64, 4, 1, 2, 0),
    "k4-bf16-v2-fp16-byte-values": (1, 2, 120, 4, 4, 2, 64, 32, 4, 1, 2, 0),
    # codebook codes (TurboQuant_mse: levels looked up in registers, one norm a token); the
    # group fields of a codebook side are unused
    "cb4-keys-and-values": (1, 2, 150, 4, 4, 4, 0, 0, 4, 2, 3, 0),
    "cb2-bf16-norms-strided": (2, 2, 130, 4, 2, 2, 0, 0, 4, 1, 2, 5),
    "cb4-keys-affine4-values-merged": (1, 2, 140, 4, 4, 4, 0, 64, 4, 2, 2, 0),
    "affine2-keys-cb2-values-gqa8": (1, 1, 120, 8, 2, 2, 64, 0, 2, 2, 2, 0),
    "cb4-keys-cb2-values-one-token": (1, 2, 1, 4, 4, 2, 0, 0, 4, 1, 1, 0),
    # symmetric levels (Lloyd-Max's, KCB / VCB 2: 4 bits in half the table, 2 bits without
    # permutes)
    "cb4-symmetric-bf16-norms-strided": (2, 2, 130, 4, 4, 4, 0, 0, 4, 2, 2, 5),
    "cb4-symmetric-keys-general-values-merged": (1, 2, 140, 4, 4, 4, 0, 0, 4, 1, 3, 0),
    "cb2-symmetric-keys-and-values-strided": (2, 2, 130, 4, 2, 2, 0, 0, 4, 2, 2, 3),
    "cb2-symmetric-keys-cb4-values-gqa8": (1, 1, 120, 8, 2, 4, 0, 0, 2, 2, 2, 0),
}
# which sides hold codebook codes (keys, values)
CODEBOOK_SIDES = {
    "cb4-keys-and-values": (True, True),
    "cb2-bf16-norms-strided": (True, True),
    "cb4-keys-affine4-values-merged": (True, False),
    "affine2-keys-cb2-values-gqa8": (False, True),
    "cb4-keys-cb2-values-one-token": (True, True),
    "cb4-symmetric-bf16-norms-strided": (True, True),
    "cb4-symmetric-keys-general-values-merged": (True, True),
    "cb2-symmetric-keys-and-values-strided": (True, True),
    "cb2-symmetric-keys-cb4-values-gqa8": (True, True),
}
# the codebook sides whose levels are symmetric (keys, values): KCB / VCB 2
SYMMETRIC_SIDES = {
    "cb4-symmetric-bf16-norms-strided": (True, True),
    "cb4-symmetric-keys-general-values-merged": (True, False),
    "cb2-symmetric-keys-and-values-strided": (True, True),
    "cb2-symmetric-keys-cb4-values-gqa8": (True, False),
}
# the inputs' dtype per side where not float16 (keys, values): the scales' dtype follows it
BF16_SIDES = {
    "4bit-bf16-folds-merged": ("bfloat16", "bfloat16"),
    "2bit-bf16-no-folds": ("bfloat16", "bfloat16"),
    "k4-bf16-v2-fp16-byte-values": ("bfloat16", "float16"),
    "cb2-bf16-norms-strided": ("bfloat16", "bfloat16"),
    "cb4-symmetric-bf16-norms-strided": ("bfloat16", "bfloat16"),
}
# head dims other than 128 (the lanes' channel blocks, m-tiles and groups scale with it)
MMA_DIMS = {
    "hd64-folds": 64,
    "hd256-folds-four-value-groups": 256,
    "hd64-8bit-g16-values-ldsm-fold": 64,
    "hd64-2bit-keys-ldsm": 64,
    "hd96-4bit-keys-three-segments": 96,
}
FP16_QUERY = {
    "4bit-fp16-query",
    "2bit-fp16-query-gqa8-strided",
    "4bit-fp16-query-long-ring",
    "4bit-fold-g128-fp16-query",
    "4bit-no-folds",
    "k2v2-g32-values-fp16-query",
}
# PLO = 1: the weights P as fp16 plus their residual (two value MMAs, no pipeline); the other
# cases round P to fp16 (the default) and score one step ahead where the ring has 3 stages
P_RESIDUAL = {"4bit-weights-residual", "8bit-gqa8-g32"}
# FUSE = 1 run too: several splits and batches, one split, an fp16 query and output
FUSED = {
    "4bit-b2-steps-of-two-strided",
    "one-token",
    "2bit-fp16-query-gqa8-strided",
    "mha-many-splits",  # one query row: four threads share each row's 4 channels
    "two-rows-merge-in-chunks",
    "4bit-bf16-folds-merged",  # a bfloat16 query and output
    "cb4-keys-affine4-values-merged",
    "cb4-symmetric-keys-general-values-merged",
}
FUSE_CHUNK = {"two-rows-merge-in-chunks": 4}  # the splits' weights 4 at a time (9 splits)
NO_PIPELINE = {"4bit-no-pipeline"}
# VFOLD = 1 and KFOLD = 1 (scales folded into the weights / out of the score MMA) wherever the
# layout allows it, except here
NO_FOLDS = {"4bit-no-folds", "2bit-bf16-no-folds"}
# LDSM = 1 (code words through ldmatrix: keys with KFOLD, values with VFOLD in 16-bit units
# where a group holds 8) except here: the word (4, 8 bits) and byte (2 bits) value layouts
NO_LDSM = {
    "2bit-steps-of-four",
    "4bit-fp16-query",
    "8bit-fold-four-value-groups",
    "hd64-folds",
    "k4-bf16-v2-fp16-byte-values",
}


def _codebook_side(bits: int, shape, dtype, key, symmetric: bool = False):
    """A codebook record as the kernels read it (random codes, norms and unsorted-sign,
    non-symmetric levels: nothing the lookup may assume; ``symmetric``: levels with
    ``L[n - 1 - c] = -L[c]``, vouched for) and its float32 decode with the levels rounded to
    fp16, as the tensor-core kernel holds them."""
    k1, k2, k3 = mx.random.split(key, 3)
    codes = mx.random.randint(0, 1 << bits, shape, key=k1).astype(mx.uint32)
    norm = mx.random.uniform(0.5, 2.0, shape[:-1], key=k2).astype(dtype)
    levels = mx.sort(mx.random.normal((1 << bits,), key=k3)) * 0.2 + 0.01
    if symmetric:
        levels = (levels - levels[::-1]) / 2
        assert klayout.levels_symmetric(np.asarray(levels))
    side = krec.CodebookCodes(
        bits=bits,
        dim=shape[-1],
        codes=pack(codes, bits),
        norm=norm,
        levels=levels,
        symmetric=symmetric,
    )
    lev16 = levels.astype(mx.float16).astype(mx.float32)
    return side, lev16[codes.astype(mx.int32)] * norm.astype(mx.float32)[..., None]


def _padded_bits(x: tuple, pad: int):
    """A bfloat16 emulator input ``(uint16 array, "bfloat16")`` as a token-axis slice of a
    larger buffer of random bit patterns."""
    arr, name = x
    shape = list(arr.shape)
    shape[2] += pad
    big = np.random.default_rng(1).integers(0, 1 << 16, size=shape, dtype=np.uint16)
    big[:, :, : arr.shape[2]] = arr
    return big[:, :, : arr.shape[2]], name


def _padded(x, pad: int):
    """``x`` as a token-axis slice of a larger buffer whose extra rows hold garbage."""
    if not pad:
        return np_input(x)
    arr = np_input(x)
    if isinstance(arr, tuple):  # bfloat16: its uint16 bit pattern, padded the same way
        return _padded_bits(arr, pad)
    arr = np.asarray(arr)
    shape = list(arr.shape)
    shape[2] += pad
    rng = np.random.default_rng(1)
    if np.issubdtype(arr.dtype, np.integer):
        big = rng.integers(0, np.iinfo(arr.dtype).max, size=shape, dtype=arr.dtype)
    else:
        big = (rng.standard_normal(shape) * 1e4).astype(arr.dtype)
    big[:, :, : arr.shape[2]] = arr
    return big[:, :, : arr.shape[2]]


def _mma_emulators(tmp_path_factory, tag: str):
    """Two CUDA emulator programs (the cases take turns; compiled side by side, one g++
    each) and the split merge's handle in each; the test skipped without g++."""
    emus = [_module_emulator(tmp_path_factory, f"{tag}{i}", CudaEmulator) for i in range(2)]
    parts = [np.zeros((1, 1, 2, 4, 128), np.float32)] * 2
    return emus, [e.kernel(kmerge.MERGE, parts, ["float32"] * 3) for e in emus]


@pytest.fixture(scope="module")
def mma_emulated(tmp_path_factory):
    emus, merges = _mma_emulators(tmp_path_factory, "cuemu")
    cases = {}
    for name, (b, h, t, m, kb, vb, kg, vg, nw, sub, s, pad) in MMA_CASES.items():
        emu, merge = emus[len(cases) % 2], merges[len(cases) % 2]
        d = MMA_DIMS.get(name, 128)
        k1, k2, k3 = mx.random.split(mx.random.key(len(cases)), 3)
        kdt, vdt = (getattr(mx, x) for x in BF16_SIDES.get(name, ("float16", "float16")))
        k = mx.random.normal((b, h, t, d), key=k1).astype(kdt)
        v = mx.random.normal((b, h, t, d), key=k2).astype(vdt)
        q = mx.random.normal((b, h, m, d), key=k3) * 0.3
        if name in FP16_QUERY:
            q = q.astype(mx.float16)
        elif name in BF16_SIDES:
            q = q.astype(mx.bfloat16)
        kcb, vcb = CODEBOOK_SIDES.get(name, (False, False))
        ksym, vsym = SYMMETRIC_SIDES.get(name, (False, False))
        kc, vc = Uniform(kb, group=kg or 64), Uniform(vb, group=vg or 64)
        kp, vp = kc.encode(k), vc.encode(v)
        keys, vals = kc.kernel_codes(kp), vc.kernel_codes(vp)  # (codebook sides replace them)
        kd, vd = kc.decode(kp).astype(mx.float32), vc.decode(vp).astype(mx.float32)
        if kcb:
            kkey = mx.random.key(100 + len(cases))
            keys, kd = _codebook_side(kb, (b, h, t, d), kdt, kkey, ksym)
        if vcb:
            vkey = mx.random.key(200 + len(cases))
            vals, vd = _codebook_side(vb, (b, h, t, d), vdt, vkey, vsym)
        assert kmma.mma_supported(m, d, keys, vals)
        stages = kmsup.mma_stages(d, keys, vals, nw, sub)
        pres, pipe = name in P_RESIDUAL, name not in NO_PIPELINE
        fold, ldsm = name not in NO_FOLDS, name not in NO_LDSM
        args = (d, keys, vals, m, nw, stages, sub, None, q.dtype, pres, pipe, fold)
        tmpl = kmsup.mma_template(*args, key_fold=fold, ldsm=ldsm)
        tm = dict(tmpl)
        assert tm["QLO"] == (0 if name in FP16_QUERY or name in BF16_SIDES else 1)
        assert (tm["KSBF"], tm["VSBF"]) == (kdt == mx.bfloat16, vdt == mx.bfloat16)
        assert (tm["KCB"], tm["VCB"]) == (kcb + ksym, vcb + vsym)
        assert not (kcb and not tm["KFOLD"]) and not (vcb and not tm["VFOLD"])
        assert tm["PIPE"] == int(pipe and not pres and stages >= 3)
        # 8 16-bit units (LDSM), else 8 words at 4 and 8 bits, 8 bytes at 2
        kg, vg = kg or d, vg or d  # a codebook side: one norm a token
        vok = (ldsm and vg % (128 // vb) == 0) or vg % (64 if vb == 4 else 32) == 0
        assert tm["VFOLD"] == int(fold and not pres and vok and d // vg <= 4)
        assert tm["KFOLD"] == int(fold and kg % (128 // kb) == 0 and d // kg <= 2)
        out_dt = (mx.float16 if name in FP16_QUERY else q.dtype) if name in FUSED else None
        ftmpl = kmsup.mma_template(*args, out_dt, FUSE_CHUNK.get(name, 0), key_fold=fold, ldsm=ldsm)
        lay = (b, h, s, m, d)
        handle, ins, launch, fused = _register_mma(
            emu, q, keys, vals, pad, lay, tmpl, ftmpl, out_dt
        )
        # the reference: keys and values decoded, rounded to fp16 as the kernel decodes them;
        # folded sides are not decoded (their products carry fp16 roundings of q, P s instead;
        # a codebook side's levels are fp16, its norms float32 or in P s)
        if not tm["KFOLD"]:
            kd = kd.astype(mx.float16).astype(mx.float32)
        if not tm["VFOLD"]:
            vd = vd.astype(mx.float16).astype(mx.float32)
        scores = q.astype(mx.float32) @ mx.swapaxes(kd, -1, -2)
        cases[name] = _MmaCase(emu, merge, handle, ins, lay, launch, scores, vd, fused)
    with concurrent.futures.ThreadPoolExecutor(max_workers=2) as pool:
        list(pool.map(CudaEmulator.build, emus))
    return cases


def _register_mma(emu, q, keys, vals, pad, lay, tmpl, ftmpl, out_dt):
    """One tensor-core case's kernels in ``emu``: the launch with its partials as two outputs,
    as the library launches it without a merge, and with ``out_dt`` the same kernel merging
    its own splits (FUSE = 1, template ``ftmpl``); the planes strided with ``pad`` garbage
    rows. Returns ``(handle, inputs, launch, fused)`` for :class:`_MmaCase`."""
    b, h, s, m, d = lay
    nw = dict(tmpl)["NWARPS"]
    planes = [*kmma.mma_inputs(keys)[:3], *kmma.mma_inputs(vals)[:3]]
    levels = [kmma.mma_inputs(keys)[3], kmma.mma_inputs(vals)[3]]
    ins = [np_input(q)] + [_padded(x, pad) for x in planes] + [np_input(x) for x in levels]
    spec = kmsup.mma_spec(nw, kmsup.mma_sm_blocks(nw), parts=True)
    handle = emu.kernel(spec, ins, ["float32", "float32"], tmpl)
    launch = ((s * nw * 32, b * h, 1), (nw * 32, 1, 1))
    fused = None
    if out_dt is not None:
        fspec = kmsup.mma_spec(nw, kmsup.mma_sm_blocks(nw))
        fused = (emu.kernel(fspec, ins, ["float32"], ftmpl), kmma.mma_layout(b, h, s, m, d, out_dt))
    return handle, ins, launch, fused


@dataclasses.dataclass
class _MmaCase:
    """One tensor-core case: its program and the merge kernel's handle in it, its launch (the
    partials as two outputs), inputs, the reference's scores and values, and the FUSE = 1
    launch where the case has one."""

    emu: CudaEmulator
    merge: int
    handle: int
    ins: list
    lay: tuple[int, int, int, int, int]
    launch: tuple[tuple[int, int, int], tuple[int, int, int]]
    scores: mx.array
    vd: mx.array
    fused: tuple | None
    out: tuple | None = None

    def run(self) -> tuple[np.ndarray, ...]:
        """``(ml, o_part)`` of the launch and ``(o, m, l)`` of the separate merge over them,
        computed once (emulation is slow; both tests read them)."""
        if self.out is None:
            b, h, s, m, d = self.lay
            ml, o_part = self.emu.run(
                self.handle, self.ins, [(b, h, s, m, 2), (b, h, s, m, d)], *self.launch
            )
            shapes = [(b, h, m, d), (b, h, m, 1), (b, h, m, 1)]
            grid, tg = kmerge.merge_launch(b * h * m, d)
            self.out = (ml, o_part, *self.emu.run(self.merge, [o_part, ml], shapes, grid, tg))
        return self.out


@needs_gxx
@pytest.mark.parametrize("name", list(MMA_CASES))
def test_tensor_core_kernel_matches_the_reference(mma_emulated, name):
    """The CUDA-only kernel, run lane by lane on the CPU (mma.sync fragments, cp.async rings,
    warp votes and shuffles emulated), and its split merge: the softmax output equals the
    reference over the decoded keys and values (rounded to fp16 where the kernel decodes a
    side, float32 where it folds its scales); no split's max exceeds the true max (the lazy
    max may only lag)."""
    # fp16 weights: each rounded to 2^-11 relative; with the residual exact to float32 sums
    _check_softmax(mma_emulated[name], 1e-5 if name in P_RESIDUAL else 1e-3)


def _check_softmax(case: _MmaCase, tol: float) -> float:
    """A case's softmax output (its partials merged) against its reference within ``tol``
    relative, its splits' maxima at most 8 bits below the true max and none above it;
    returns the output's largest error relative to the reference's largest magnitude."""
    ml, o_part, o, mm, ll = case.run()
    scores = case.scores
    want = np.asarray(mx.softmax(scores, axis=-1) @ case.vd)
    err = float(np.abs(o / ll - want).max() / max(1.0, np.abs(want).max()))
    assert err <= tol, err
    top = np.asarray(mx.max(scores, axis=-1, keepdims=True))
    assert np.all(mm <= top + 1e-4) and np.all(mm >= top - 8 * math.log(2) - 1e-4)
    assert np.all(np.isfinite(o_part)) and np.all(ml[..., 1] >= 0)
    return err


@needs_gxx
def test_subnormal_probe_finds_exact_sums_and_flushed_operands(tmp_path):
    """The probe the folds depend on (one MMA of subnormal codes times ones), emulated lane
    by lane: its row sums equal the host's for several salts; outputs of a device that
    flushed subnormals to zero (all zeros) or dropped one code's offset are told apart."""
    emu = CudaEmulator(tmp_path)
    salt = np.array([kmsup.SUBNORMAL_SALT], np.uint32)
    handle = emu.kernel(kmsup.PROBE_SUBNORMAL, [salt], ["float32"], [])
    for s in (0, kmsup.SUBNORMAL_SALT, 11):
        (out,) = emu.run(handle, [np.array([s], np.uint32)], [(128,)], (32, 1, 1), (32, 1, 1))
        assert kmsup.subnormal_probe_error(out, s) == 0.0
    assert kmsup.subnormal_probe_error(np.zeros(128, np.float32), 3) == 1.0
    want = np.array(kmsup.subnormal_probe_expected(3), np.float32)
    off = want.copy()
    off[5] += 2.0**-24  # one code one unit off
    assert 0 < kmsup.subnormal_probe_error(off, 3) < 1e-3
    with pytest.raises(ValueError, match="128"):
        kmsup.subnormal_probe_error(want[:64], 3)


def test_folds_stay_off_where_subnormal_operands_are_not_exact(monkeypatch):
    """Both folds need exact subnormal MMA operands: with the probe failing, the launch plan
    decodes both sides (KFOLD = VFOLD = 0) whatever the settings ask; with no CUDA device
    nothing is probed and the folds follow the settings."""
    z = mx.zeros((1, 8, 600, 2), mx.float16)
    k = krec.AffineCodes(
        bits=4, group=64, codes=mx.zeros((1, 8, 600, 16), mx.uint32), scale=z, zero=z
    )
    q_shape = (1, 8, 4, 128)
    on = dict(kmma.mma_launch(q_shape, mx.float16, k, k).template)
    assert kmma.mma_subnormals_exact() and on["KFOLD"] == on["VFOLD"] == 1
    monkeypatch.setattr("velox_core.kernels.mma.mma_subnormals_exact", lambda: False)
    off = dict(kmma.mma_launch(q_shape, mx.float16, k, k, value_fold=True, key_fold=True).template)
    assert off["KFOLD"] == off["VFOLD"] == 0


@needs_gxx
@pytest.mark.parametrize("name", sorted(FUSED))
def test_tensor_core_kernel_merges_its_own_splits(mma_emulated, name):
    """FUSE = 1: the last threadgroup of each (batch, head) merges the splits' partials in the
    same launch (counted on a zeroed output): the normalized output, its max and its sum
    equal the separate merge kernel's over the same partials."""
    _check_fused(mma_emulated[name])


def _check_fused(case: _MmaCase) -> None:
    """A case's FUSE = 1 launch: its partials are the separate launch's bit for bit, every
    threadgroup counted, and its merged output, max and sum the separate merge's."""
    b, h, s, _, _ = case.lay
    (fhandle, flay) = case.fused
    ml, o_part, o, mm, ll = case.run()  # the separate merge's (computed once per case)
    (fws,) = case.emu.run(fhandle, case.ins, [(flay.size,)], *case.launch, init=0)
    fo_part, fml, out, mlo, count = mma_fused_parts(flay, fws)
    assert np.array_equal(fo_part, o_part) and np.array_equal(fml, ml)
    assert np.array_equal(count, np.full(b * h, s, np.uint32))  # every threadgroup counted
    ref = o / ll
    # the output dtype's rounding (a bfloat16 output comes widened to float32)
    tol = {"float16": 2e-3, "bfloat16": 8e-3}.get(str(flay.out_dtype).split(".")[-1], 1e-6)
    assert np.abs(out.astype(np.float32) - ref).max() <= tol * max(1.0, np.abs(ref).max())
    assert np.allclose(mlo[..., :1], mm, rtol=1e-6, atol=1e-6)
    assert np.allclose(mlo[..., 1:], ll, rtol=1e-5)
    want = np.asarray(mx.softmax(case.scores, axis=-1) @ case.vd)
    bound = max(tol, 2e-3) * max(1.0, np.abs(want).max())
    assert np.abs(out.astype(np.float32) - want).max() <= bound


# per-channel keys (KIVI's: KCH = 1, scale rows per group of tokens folded into the query)
KIVI_CASES = {
    # name: (B, H, T, M, key bits, value bits, key group (tokens), value group, head dim, warps,
    #        subtiles, splits, pad, scales' dtype, query dtype: KIVI_DTYPES)
    # steps of 64 tokens over groups of 32 (two scale rows a stage), the last step partial
    "k2v2-g32-partial-step": (1, 2, 96, 4, 2, 2, 32, 32, 128, 2, 4, 2, 0, "f16", "f16"),
    "k4v4-g64-b2-bf16-scales-strided": (2, 2, 320, 4, 4, 4, 64, 64, 128, 4, 2, 3, 5, "bf16", "f32"),
    "k2v4-g128-hd64-one-row": (1, 2, 256, 1, 2, 4, 128, 32, 64, 4, 2, 2, 0, "f16", "f16"),
    "k4v4-g32-hd64-bf16": (1, 2, 128, 4, 4, 4, 32, 32, 64, 2, 2, 3, 0, "bf16", "bf16"),
    "k2v2-g32-tiny-query": (1, 2, 160, 4, 2, 2, 32, 32, 128, 4, 2, 2, 0, "f16", "f16"),
    # groups that neither hold nor fill whole steps: three rows a stage, found per tile
    "k4v4-g48-steps-of-four": (1, 2, 240, 2, 4, 4, 48, 64, 128, 2, 4, 2, 0, "f16", "f32"),
    "k8v8-g16-no-ldsm": (1, 2, 112, 3, 8, 8, 16, 32, 128, 2, 2, 2, 0, "f16", "f32"),
    "k2v2-g32-gqa8-five-splits": (1, 1, 640, 8, 2, 2, 32, 32, 128, 4, 2, 5, 0, "f16", "bf16"),
    "k2v2-g64-weights-residual": (1, 2, 192, 4, 2, 2, 64, 32, 128, 4, 2, 2, 3, "f16", "f16"),
}
KIVI_DTYPES = {"f16": mx.float16, "bf16": mx.bfloat16, "f32": mx.float32}
KIVI_FUSED = {
    "k2v2-g32-partial-step",
    "k2v4-g128-hd64-one-row",
    "k4v4-g32-hd64-bf16",
    "k2v2-g32-gqa8-five-splits",
}
KIVI_NO_LDSM = {"k8v8-g16-no-ldsm"}
KIVI_P_RESIDUAL = {"k2v2-g64-weights-residual"}  # PLO = 1: the values decoded, no pipeline


def _kivi_scores(q, kc: Uniform, kp, half_query: bool) -> mx.array:
    """The reference scores over per-channel keys: ``q . k`` with the keys decoded in
    float32, or, for a query that goes into the MMA as it is (fp16 or bf16: QLO = 0), as the
    kernel rounds them: ``sum_d fp16(q_d s_Gd) c_td + q . z_G`` (``s`` as fp16)."""
    kd = kc.decode(kp).astype(mx.float32)
    qf = q.astype(mx.float32)
    if not half_query:
        return qf @ mx.swapaxes(kd, -1, -2)
    b, h, t, d = kd.shape
    g = kc.group
    s = kp.data["scale"].astype(mx.float16).astype(mx.float32)  # (B, H, T / g, D)
    z = kp.data["zero"].astype(mx.float32)
    c = unpack(kp.data["codes"], kc.bits, d).astype(mx.float32).reshape(b, h, t // g, g, d)
    qs = (qf[:, :, :, None, :] * s[:, :, None]).astype(mx.float16).astype(mx.float32)
    sc = mx.einsum("bhmnd,bhngd->bhmng", qs, c).reshape(b, h, q.shape[2], t)
    return sc + mx.repeat(mx.einsum("bhmd,bhnd->bhmn", qf, z), g, axis=-1)


@pytest.fixture(scope="module")
def kivi_emulated(tmp_path_factory):
    emus, merges = _mma_emulators(tmp_path_factory, "kiviemu")
    cases = {}
    for i, (name, case) in enumerate(KIVI_CASES.items()):
        b, h, t, m, kb, vb, kg, vg, d, nw, sub, s, pad, sdt, qdt = case
        k1, k2, k3, k4 = mx.random.split(mx.random.key(300 + i), 4)
        # keys with outlier channels (KIVI's case: an offset per channel, large zeros)
        k = mx.random.normal((b, h, t, d), key=k1) + 3.0 * mx.random.normal((d,), key=k4)
        k, v = k.astype(KIVI_DTYPES[sdt]), mx.random.normal((b, h, t, d), key=k2)
        q = mx.random.normal((b, h, m, d), key=k3) * (3e-4 if "tiny" in name else 0.3)
        q = q.astype(KIVI_DTYPES[qdt])
        kc, vc = Uniform(kb, group=kg, axis="channel"), Uniform(vb, group=vg)
        kp, vp = kc.encode(k), vc.encode(v.astype(KIVI_DTYPES[sdt]))
        keys = kc.kernel_codes(kp)
        vals = vc.kernel_codes(vp)
        assert keys.kind == krec.AFFINE_CHANNEL and kmma.mma_supported(m, d, keys, vals)
        half = q.dtype in kmsup.MMA_HALF_QUERY
        stages = kmsup.mma_stages(d, keys, vals, nw, sub, not half)
        pres, ldsm = name in KIVI_P_RESIDUAL, name not in KIVI_NO_LDSM
        args = (d, keys, vals, m, nw, stages, sub, None, q.dtype, pres, True, True)
        tmpl = kmsup.mma_template(*args, key_fold=True, ldsm=ldsm)
        tm = dict(tmpl)
        assert (tm["KCH"], tm["KFOLD"], tm["QLO"], tm["LDSM"]) == (1, 0, int(not half), ldsm)
        assert tm["KSBF"] == (sdt == "bf16") and tm["VFOLD"] == int(not pres)
        out_dt = q.dtype if name in KIVI_FUSED else None
        ftmpl = kmsup.mma_template(*args, out_dt, key_fold=True, ldsm=ldsm)
        lay = (b, h, s, m, d)
        emu = emus[i % 2]
        handle, ins, launch, fused = _register_mma(
            emu, q, keys, vals, pad, lay, tmpl, ftmpl, out_dt
        )
        vd = vc.decode(vp).astype(mx.float32)
        if pres:  # decoded values: rounded to fp16 as the kernel decodes them
            vd = vd.astype(mx.float16).astype(mx.float32)
        scores = _kivi_scores(q, kc, kp, half)
        cases[name] = _MmaCase(emu, merges[i % 2], handle, ins, lay, launch, scores, vd, fused)
    with concurrent.futures.ThreadPoolExecutor(max_workers=2) as pool:
        list(pool.map(CudaEmulator.build, emus))
    return cases


@needs_gxx
@pytest.mark.parametrize("name", list(KIVI_CASES))
def test_tensor_core_kernel_folds_per_channel_key_scales(kivi_emulated, name):
    """Per-channel keys (KIVI's, KCH = 1), emulated lane by lane: each group's scales folded
    into the query's B fragments, its zeros' term from one MMA chain, the scale rows of the
    groups a step meets in its ring stage; the softmax output equals the reference over the
    decoded keys (float32 for a float32 query; for an fp16 or bf16 one with q s rounded to
    fp16 as the kernel forms it) and values, for 2, 4 and 8 bits, groups of 16 to 128
    tokens, fp16 and bf16 scales, head dims 64 and 128, 1 to 8 query rows, partial steps,
    several splits and a tiny query; FUSE = 1 where it runs merges as the separate merge."""
    case = kivi_emulated[name]
    _check_softmax(case, 1e-5 if name in KIVI_P_RESIDUAL else 1e-3)
    if case.fused is not None:
        _check_fused(case)


def test_per_channel_keys_take_the_tensor_core_kernel_in_whole_tile_groups():
    """The tensor-core kernel takes per-channel keys of 2, 4 or 8 bits in groups of a multiple
    of 16 tokens over whole groups (KCH, no KFOLD; the stage's scale rows as the kernel counts
    them), and not other groups, bit widths, values or scale dtypes."""
    ok = kmma.mma_supported
    v = _mma_codes(2, 32)
    for bits, group in ((2, 32), (4, 64), (2, 128), (8, 16), (4, 48)):
        k = _mma_codes(bits, f"c{group}", t=768 if group == 48 else 256)
        assert ok(4, 128, k, v), (bits, group)
        tm = dict(kmma.mma_launch((1, 1, 4, 128), mx.float16, k, v).template)
        assert tm["KCH"] == 1 and tm["KFOLD"] == 0 and tm["NSTAGE"] >= 2
    assert ok(8, 128, _mma_codes(2, "c32", mx.bfloat16), v)
    assert ok(1, 64, _mma_codes(4, "c32", dim=64), _mma_codes(4, 32))
    assert not ok(4, 128, _mma_codes(2, "c8"), v)  # a 16-token tile would span groups
    assert not ok(4, 128, _mma_codes(2, "c40"), v)
    assert not ok(4, 128, _mma_codes(3, "c32"), v)  # 3-bit codes straddle words
    assert not ok(4, 128, _mma_codes(2, "c32", mx.float32), v)  # fp16 or bf16 scales only
    assert not ok(4, 128, v, _mma_codes(2, "c32"))  # per-channel groups are for keys only
    k = _mma_codes(2, "c32")
    assert not ok(4, 128, dataclasses.replace(k, codes=k.codes[:, :, :200]), v)  # 6.25 groups
    assert not ok(4, 128, dataclasses.replace(k, zero=k.zero.astype(mx.bfloat16)), v)  # two dtypes
    assert not kmsup.mma_key_fold_ok(_mma_codes(4, "c64"), 128)
    assert (kmsup.mma_key_rows(32, 64), kmsup.mma_key_rows(64, 32), kmsup.mma_key_rows(64, 48)) == (
        1,
        2,
        3,
    )
    assert kmsup.mma_key_rows(32, 48) == 2 and kmsup.mma_key_rows(64, 16) == 4


@needs_gxx
@pytest.mark.parametrize(
    "window,sinks,dtype,axis",
    [
        (16, 4, "float16", "token"),
        (16, 0, "float16", "token"),
        (0, 4, "float16", "token"),
        (0, 0, "float16", "token"),
        (16, 4, "bfloat16", "token"),
        (0, 0, "bfloat16", "token"),
        # KIVI's layout: 2-bit per-channel keys in groups of 32 tokens (KCH)
        (16, 4, "float16", "channel"),
        (0, 0, "bfloat16", "channel"),
    ],
)
def test_cache_on_an_emulated_cuda_gpu_takes_the_tensor_core_kernel(
    monkeypatch, tmp_path, window, sinks, dtype, axis
):
    """A float16 or bfloat16 UniformCache (a bfloat16 model's: bfloat16 scales and zeros),
    per-token or with KIVI's per-channel keys, attended with the backend reported as CUDA:
    its coded body goes through the tensor-core kernel and its sinks and window through the
    merge, in one softmax (both emulated); attention matches the reference path to the
    rounding of the decoded values."""
    dt = getattr(mx, dtype)
    k, v = kv_data(t=300 if axis == "token" else 256, dtype=dt)
    q = mx.random.normal((1, 4, 1, 128), key=mx.random.key(9)).astype(dt)
    kivi = {"bits": 2, "group": 32} if axis == "channel" else {"bits": 4}
    cache = UniformCache(**kivi, key_axis=axis, window=window, sinks=sinks)
    cache.update_and_fetch(k, v)  # encoded on the CPU path
    ref = cache.attend(q, 0.088)
    fake = EmulatedKernels(tmp_path, backend="cuda").install(monkeypatch)
    got = cache.attend(q, 0.088)
    names = fake.names
    nw = kcfg.kernel_config().mma_warps
    # no fp16 tokens: the tensor-core kernel merges its own splits (one launch); with them its
    # partials are two outputs of their own, which the merge reads
    fused, parts = (
        kmsup.mma_spec(nw, kmsup.mma_sm_blocks(nw)),
        kmsup.mma_spec(nw, kmsup.mma_sm_blocks(nw), True),
    )
    want = [fused.name] if window == sinks == 0 else [parts.name, "velox_decode_merge_fp16"]
    assert names == want
    assert got.dtype == ref.dtype == dt
    err = np.abs(np.asarray((got - ref).astype(mx.float32))).max()
    tol = 2e-3 if dt == mx.float16 else 1e-2  # bfloat16 outputs: 2^-9 relative rounding
    assert err < tol * np.abs(np.asarray(ref.astype(mx.float32))).max()


def test_uniform_kernel_codes_are_its_record_as_the_kernels_read_it():
    """``Uniform.kernel_codes``: the kernels' view of a record (what the codec's own kernel
    sides and QJL's and VecInfer's value sides take): per-token codes as AffineCodes,
    per-channel keys as ChannelAffineCodes, with the record's own arrays, bits and group (and
    the kernels' view of them: ``a`` the scales, ``b`` the zeros, no levels)."""
    x = mx.random.normal((1, 2, 64, 128), key=mx.random.key(3)).astype(mx.float16)
    for codec, record, kind in (
        (Uniform(4, 32), krec.AffineCodes, krec.AFFINE),
        (Uniform(2, 32, "channel"), krec.ChannelAffineCodes, krec.AFFINE_CHANNEL),
    ):
        rec = codec.encode(x)
        c = codec.kernel_codes(rec)
        assert type(c) is record and (c.kind, c.bits, c.group) == (kind, codec.bits, 32)
        assert c.codes is rec.data["codes"] and c.scale is rec.data["scale"]
        assert c.zero is rec.data["zero"] and c.a is c.scale and c.b is c.zero
        assert c.levels is None


def test_mlx_quantized_matmul_is_not_used_on_cuda(monkeypatch):
    """Codes in MLX's layout go through mx.quantized_matmul, except on MLX's CUDA backend
    (which lacks shapes a cache meets): one rule for every codec that uses it."""
    from velox_core.ops import mlx_readable

    assert mlx_readable(4, 64) and not mlx_readable(7, 64) and not mlx_readable(4, 16)
    monkeypatch.setattr(vk, "backend", lambda: "cuda")
    assert not mlx_readable(4, 64)
    assert not Uniform(4)._mlx_layout()


@needs_gxx
def test_decode_steps_reuse_one_plan_until_the_codes_grow(monkeypatch, tmp_path):
    """Decode steps over an emulated GPU (Metal): the cache plans its joint attention once
    per coded segment (``plan_decode`` again only after a flush), each step's output matches
    attention over the decoded cache, and a step launches only the decode kernel and the
    merge (and, at the flush, the encode kernel for keys and values)."""
    k, v = kv_data(t=120, dtype=mx.float16)
    cache = UniformCache(bits=4, sinks=2, flush=8)
    cache.update_and_fetch(k[:, :, :100], v[:, :, :100])  # encoded on the CPU path
    fake = EmulatedKernels(tmp_path).install(monkeypatch)
    planned = []
    plan = dk.plan_decode

    def counting(*a, **kw):
        planned.append(a[2].codes.shape[2])
        return plan(*a, **kw)

    monkeypatch.setattr(dk, "plan_decode", counting)
    for i in range(100, 112):
        cache.update_and_fetch(k[:, :, i : i + 1], v[:, :, i : i + 1])
        q = mx.random.normal((1, 4, 1, 128), key=mx.random.key(i)).astype(mx.float16)
        got = cache.attend(q, 0.088)
        kk, vv = (x.astype(mx.float32) for x in cache.keys_and_values())
        ref = mx.fast.scaled_dot_product_attention(q.astype(mx.float32), kk, vv, scale=0.088)
        err = float(mx.max(mx.abs(got.astype(mx.float32) - ref)).item())
        # fp16 output and fp16 weights in the value mix (a stale plan errs by O(1))
        assert err < 5e-3 * float(mx.max(mx.abs(ref)).item()), (i, err)
    # 98 coded tokens after the prefill (2 sinks), 106 after the flush at step 8
    assert planned == [98, 106]
    names = fake.names
    assert set(names) == {
        "velox_decode_attention",
        "velox_decode_merge_fp16",
        "velox_encode_affine",
    }
    assert names.count("velox_decode_attention") == names.count("velox_decode_merge_fp16") == 12
    assert names.count("velox_encode_affine") == 2
