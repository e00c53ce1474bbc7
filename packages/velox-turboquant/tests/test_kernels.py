"""TurboQuant's kernel paths, checked on a machine without a GPU.

The decode kernel is velox-core's (``metal/decode_attention.metal`` with codebook codes); the
encode kernels are this package's (``metal/encode_codebook.metal``,
``metal/encode_residual_sketch.metal``). Here the TurboQuant glue is checked: which codecs
take the kernel path, and — with the kernels' Metal instantiation emulated on the CPU
(``velox_testing.emulate``) — that the rotated-domain attention and the fused encode match
the reference; and the encode kernels themselves: they compile for Metal and CUDA and give
the reference's codes and sketches.
"""

from __future__ import annotations

import math
import shutil

import mlx.core as mx
import numpy as np
import pytest

import velox_core.kernels as vk
from velox_core import Uniform
from velox_core.cache.attention import Segment, fused_partial
from velox_core.kernels.build import ArgInfo
from velox_core.kernels.encode import THREADS
from velox_core.ops import pack, sign_sketch
from velox_testing import (
    assert_cpu_declines,
    assert_kernel_partial,
    assert_step_like_reference,
    kernel_env,
    kv_data,
    sign_words,
)
from velox_testing.emulate import EmulatedKernels, Emulator, emulated_or_skip
from velox_testing.kernel_path import INSTANTIATIONS, assert_ships, compile_instantiation
from velox_turboquant import TurboQuant, TurboQuantCache
from velox_turboquant.encode import CODEBOOK_ENCODE, RESIDUAL_SKETCH_ENCODE
from velox_turboquant.residual import lloyd_max_sphere

needs_gxx = pytest.mark.skipif(
    shutil.which("g++") is None, reason="g++ is not installed: the kernels cannot be emulated"
)


def records(bits, t=200, key_variant="mse", seed=0, value_variant="mse"):
    k, v = kv_data(t=t, seed=seed)
    kc, vc = TurboQuant(bits, key_variant), TurboQuant(bits, value_variant, seed=1)
    for c in (kc, vc):
        c.check(128, mx.float16)
    return kc, kc.encode(k), vc, vc.encode(v)


@pytest.fixture
def emulated_gpu(monkeypatch, tmp_path):
    return emulated_or_skip(monkeypatch, tmp_path)


def test_attend_partial_is_none_on_the_cpu():
    assert_cpu_declines(*records(4, t=32))


def test_attend_partial_declines_what_the_kernel_does_not_cover(monkeypatch):
    sketch_only = records(1, t=64, key_variant="prod")  # 1-bit prod: no Lloyd-Max codes
    prod_values = records(3, t=64, value_variant="prod")
    frac_prod = records(2.5, t=64, key_variant="prod")  # fractional prod keys
    kc, kp, _, _ = records(4, t=64)
    u = Uniform(4)
    up = u.encode(kv_data(t=64)[1])
    monkeypatch.setattr(vk, "backend", lambda: "cuda")  # a GPU as far as dispatch can tell
    called = []
    monkeypatch.setattr(
        "velox_core.kernels.decode.decode_attention", lambda *a, **k: called.append(a) or None
    )
    q = mx.zeros((1, 2, 4, 128))
    assert fused_partial(q, Segment(*sketch_only)) is None  # the sketch alone
    assert fused_partial(q, Segment(*prod_values)) is None  # prod values
    assert fused_partial(q, Segment(*frac_prod)) is None  # fractional prod keys
    assert fused_partial(q, Segment(kc, kp, u, up)) is None  # another value codec
    assert not called


@needs_gxx
@pytest.mark.parametrize("bits", [2, 3, 4])
def test_emulated_kernel_attention_matches_the_reference(emulated_gpu, bits):
    """Rotated query against levels x norms, values mixed in the rotated domain, one inverse
    rotation: the kernel path equals the codec's reference scores/mix path."""
    kc, kp, vc, vp = records(bits, t=150 + bits)  # (encoded by the emulated kernel)
    q = mx.random.normal((1, 2, 4, 128), key=mx.random.key(bits)) * 0.2
    assert_kernel_partial(emulated_gpu, q, kc, kp, vc, vp, 2e-5, "velox_decode_attention")


@needs_gxx
@pytest.mark.parametrize("bits", [2, 4])
def test_emulated_kernel_attention_with_prod_keys_matches_the_reference(emulated_gpu, bits):
    """TurboQuant_prod keys (Lloyd-Max codes and the residual's QJL sketch): the kernel adds
    the sketch's estimate to each score; the kernel path equals the codec's reference
    scores/mix path."""
    kc, kp, vc, vp = records(bits, t=150 + bits, key_variant="prod")
    assert "signs" in kp.data
    q = mx.random.normal((1, 2, 4, 128), key=mx.random.key(bits)) * 0.2
    assert_kernel_partial(emulated_gpu, q, kc, kp, vc, vp, 2e-5, "velox_decode_attention")


@needs_gxx
def test_query_sketch_is_exact_with_tf32_sized_parts():
    """The sketched query is one matmul over bfloat16 parts (exact in a GPU's TF32 products):
    it equals the float32 product, and the parts themselves hold at most 8-bit mantissas."""
    from velox_turboquant.kernels import _bf16_parts, _query_sketch

    codec = TurboQuant(4, "prod")
    codec.check(128, mx.float16)
    quant = codec.parts[0][1]
    q = mx.random.normal((2, 8, 4, 128), key=mx.random.key(3)) * 3.0
    got = _query_sketch(quant, q)
    want = (q @ quant.sketch.T) * quant.qjl
    top = np.abs(np.asarray(want)).max()
    assert np.abs(np.asarray(got - want)).max() <= 2.0**-16 * top  # the q_lo S_lo term: 2^-18
    hi, lo = _bf16_parts(q)
    s_hi = _bf16_parts(quant.sketch)[0]
    coarse = (hi @ s_hi.T) * quant.qjl  # what one TF32-like product of rounded factors gives
    assert np.abs(np.asarray(coarse - want)).max() > 2.0**-12 * top
    assert mx.array_equal(hi.astype(mx.bfloat16).astype(mx.float32), hi).item()
    assert np.abs(np.asarray(lo)).max() <= 2.0**-8 * np.abs(np.asarray(q)).max()


@pytest.mark.parametrize("bits, variant", [(3, "prod"), (4, "rvq")])
def test_emulated_cache_with_other_keys_attends_like_the_reference(
    emulated_gpu, monkeypatch, bits, variant
):
    """A TurboQuantCache with prod keys (the sketch term in the kernel) or rvq keys (the
    summed-stage table as a codebook), sinks and window: its decode step takes the kernel and
    the rotating merge, and matches the reference cache; rvq's key codes (encoded by MLX ops
    on both paths) are the reference's."""
    k, v = kv_data(t=120)
    q = mx.random.normal((1, 4, 1, 128), key=mx.random.key(5)).astype(mx.float16)
    cache, ref_cache = assert_step_like_reference(
        emulated_gpu,
        monkeypatch,
        lambda: TurboQuantCache(bits=bits, key_variant=variant, window=8, sinks=4),
        k,
        v,
        q,
    )
    if variant == "rvq":
        body, ref_body = cache.segments()[1], ref_cache.segments()[1]
        assert mx.array_equal(body.keys.data["codes"], ref_body.keys.data["codes"]).item()


@needs_gxx
@pytest.mark.parametrize("sinks", [0, 4])
def test_emulated_cache_encodes_bit_exact_and_attends(emulated_gpu, monkeypatch, sinks):
    """TurboQuantCache with the kernels (emulated): the fused encode gives the reference codes
    and norms, and a decode step (the decode kernel on the rotated query, then the merge that
    rotates the coded part back and joins the fp16 sinks and window in one softmax) matches
    the reference cache."""
    k, v = kv_data(t=120)
    q = mx.random.normal((1, 4, 1, 128), key=mx.random.key(3)).astype(mx.float16)
    cache = TurboQuantCache(bits=3, window=8, sinks=sinks)
    cache.update_and_fetch(k, v)
    got = cache.attend(q, 0.088)
    names = emulated_gpu.names
    assert names.count("velox_encode_codebook") == 2
    assert names[-2:] == ["velox_decode_attention", "velox_decode_merge_fp16"]
    body = cache.segments()[1 if sinks else 0]

    monkeypatch.setattr(vk, "backend", lambda: "cpu")  # the reference path
    ref_cache = TurboQuantCache(bits=3, window=8, sinks=sinks)
    ref_cache.update_and_fetch(k, v)
    ref = ref_cache.attend(q, 0.088)
    ref_body = ref_cache.segments()[1 if sinks else 0]
    for name in ("codes", "norm"):
        assert mx.array_equal(body.keys.data[name], ref_body.keys.data[name]).item()
        assert mx.array_equal(body.values.data[name], ref_body.values.data[name]).item()
    assert np.abs(np.asarray((got - ref).astype(mx.float32))).max() < 2e-3


@needs_gxx
@pytest.mark.parametrize("bits,dtype", [(3, mx.float16), (2, mx.bfloat16), (1, mx.float16)])
def test_emulated_prod_encode_gives_the_reference_record(emulated_gpu, monkeypatch, bits, dtype):
    """prod keys encode through the kernels (emulated): the codes kernel and the residual's
    sketch kernel (1 bit: QJL's sketch kernel, the residual being the vector), with the
    reference's codes and norms, its sign words (random data puts no ``S r`` within rounding
    of 0) and its residual norms within a rounding of their dtype."""
    k, _ = kv_data(t=48)
    k = k.astype(dtype)
    kc = TurboQuant(bits, "prod")
    kc.check(128, dtype)
    rec = kc.encode(k)
    mx.eval(rec.data)
    want = (
        ["velox_encode_sketch"]
        if bits == 1
        else [
            "velox_encode_codebook",
            "velox_encode_residual_sketch",
        ]
    )
    assert emulated_gpu.names == want
    monkeypatch.setattr(vk, "backend", lambda: "cpu")  # the reference path
    ref = kc.encode(k)
    assert set(rec.data) == set(ref.data)
    for name in ("codes", "norm", "signs"):
        if name in ref.data:
            assert rec.data[name].dtype == ref.data[name].dtype
            assert mx.array_equal(rec.data[name], ref.data[name]).item(), name
    got, want_rn = (np.asarray(r.data["rnorm"].astype(mx.float32)) for r in (rec, ref))
    assert rec.data["rnorm"].dtype == ref.data["rnorm"].dtype == dtype
    ulp = 2.0**-7 if dtype == mx.bfloat16 else 2.0**-10
    assert np.all(np.abs(got - want_rn) <= ulp * np.abs(want_rn))


@needs_gxx
@pytest.mark.parametrize(
    "bits,window,sinks,dtype",
    [(4, 16, 4, "float16"), (2, 0, 0, "bfloat16"), (3, 16, 4, "float16")],
)
def test_cache_on_an_emulated_cuda_gpu_rotates_back_in_the_merge(
    monkeypatch, tmp_path, bits, window, sinks, dtype
):
    """The CUDA instantiations, emulated: a TurboQuantCache attends its codes through the
    tensor-core kernel at 2 and 4 bits (the Lloyd-Max levels, symmetric, looked up in
    registers: at 4 bits in half the table, at 2 bits without permutes; the norms folded like
    scales; a bf16 model's bf16 norms too) and through the portable kernel
    at 3 bits, then the fused merge rotates the codes' partial back and joins the sinks and
    window: two launches, matching the reference path."""
    from velox_core.kernels import mma_support as kmsup
    from velox_core.kernels.config import kernel_config

    dt = getattr(mx, dtype)
    k, v = kv_data(t=150, dtype=dt)
    q = mx.random.normal((1, 4, 1, 128), key=mx.random.key(5)).astype(dt)
    cache = TurboQuantCache(bits=bits, window=window, sinks=sinks)
    cache.update_and_fetch(k, v)  # encoded on the CPU path
    ref = cache.attend(q, 0.088)
    fake = EmulatedKernels(tmp_path, backend="cuda").install(monkeypatch)
    got = cache.attend(q, 0.088)
    nw = kernel_config().mma_warps
    mma = kmsup.mma_spec(nw, kmsup.mma_sm_blocks(nw), True).name
    first = "velox_decode_attention" if bits == 3 else mma
    assert fake.names == [first, "velox_decode_merge_fp16"]
    if bits != 3:  # Lloyd-Max levels are symmetric: the kernel's symmetric lookups
        tm = dict(fake.calls[0][1])
        assert (tm["KCB"], tm["VCB"]) == (2, 2)
        assert cache.tiers[0].key_codec.parts[0][1].levels_symmetric
    assert got.dtype == ref.dtype == dt
    err = np.abs(np.asarray((got - ref).astype(mx.float32))).max()
    tol = 2e-3 if dt == mx.float16 else 1e-2  # bf16 outputs: 2^-9 relative rounding
    assert err < tol * np.abs(np.asarray(ref.astype(mx.float32))).max()


@needs_gxx
@pytest.mark.parametrize(
    "key_bits,value_bits,rows,dtype,threads",
    [
        (3.5, 3.5, 1, "float16", 64),
        (2.5, 4, 3, "bfloat16", 64),
        (4, 3.25, 8, "float16", 64),
        (3.5, 3.5, 4, "float16", 128),
        (2.5, 4, 1, "bfloat16", 128),
    ],
)
def test_emulated_outlier_kernel_matches_the_reference(
    emulated_gpu, monkeypatch, key_bits, value_bits, rows, dtype, threads
):
    """Fractional widths (outlier channels per group of 64 tokens, two rotated parts each):
    the outlier kernel places and rotates the query per group, scores both parts' codes,
    mixes the values in their rotated domain and brings them back per group: its partial
    equals the codec's reference scores/mix path. Covers a side of one part beside a
    fractional one (4-bit keys or values), bf16 norms, padded query rows (3 of 4), parts of
    96 channels (Hadamard blocks of 32 after a permutation: 3.25 bits), the butterflies with
    2 to 16 entries a thread (every stage in registers or shuffles; the cache test below:
    4), 8, 16 and 32 lanes a scored token (the rows' sums by a reduce-scatter), a thread's
    entries over one or two channels, and threadgroups of two warps (the default) and of
    four (``VELOX_OUTLIER_THREADS=128``)."""
    kernel_env(monkeypatch, "VELOX_OUTLIER_THREADS", str(threads))
    dt = getattr(mx, dtype)
    k, v = kv_data(t=320, seed=3, dtype=dt)
    kc, vc = TurboQuant(key_bits), TurboQuant(value_bits, seed=1)
    for c in (kc, vc):
        c.check(128, dt)
    kp, vp = kc.encode(k), vc.encode(v)
    q = mx.random.normal((1, 2, rows, 128), key=mx.random.key(rows)) * 0.2
    name = f"velox_decode_attention_outlier_t{threads}"
    assert_kernel_partial(emulated_gpu, q, kc, kp, vc, vp, 2e-5, name)


@needs_gxx
@pytest.mark.parametrize("backend", ["metal", "cuda"])
def test_emulated_fractional_cache_attends_like_the_reference(monkeypatch, tmp_path, backend):
    """TurboQuantCache(bits=3.5) with sinks and a window, on an emulated GPU (the Metal and
    the CUDA instantiations): the coded body (a slice of the cache's buffers, whole groups)
    goes through the outlier kernel and the fp16 tokens join in the merge's softmax, two
    launches, matching the reference cache."""
    k, v = kv_data(t=300)
    q = mx.random.normal((1, 4, 1, 128), key=mx.random.key(9)).astype(mx.float16)
    cache = TurboQuantCache(bits=3.5, window=8, sinks=4)
    cache.update_and_fetch(k, v)  # encoded on the CPU path
    ref = cache.attend(q, 0.088)
    fake = EmulatedKernels(tmp_path, backend=backend).install(monkeypatch)
    got = cache.attend(q, 0.088)
    assert fake.names == ["velox_decode_attention_outlier_t64", "velox_decode_merge_fp16"]
    assert got.dtype == ref.dtype == mx.float16
    err = np.abs(np.asarray((got - ref).astype(mx.float32))).max()
    assert err < 2e-3 * np.abs(np.asarray(ref.astype(mx.float32))).max()


# -- the encode kernels, shipped by this package -------------------------------------------------


def _encode_variants():
    """The encode kernels' instantiations: 3-bit codes; residual sketches with S float32
    (TurboQuant's) or float16, and a partial last word."""
    infos = [ArgInfo("float32", 2, 1 << 20), ArgInfo("float32", 1, 7)]
    out = [(CODEBOOK_ENCODE, infos, ["uint32"], [("BITS", 3), ("HD", 128)])]
    for bits, m, s_dtype, nt in ((2, 128, "float32", mx.float16), (3, 100, "float16", mx.bfloat16)):
        infos = [ArgInfo("float32", 2, 1 << 20), ArgInfo(s_dtype, 2, 1 << 14)]
        infos += [ArgInfo("float32", 1, (1 << bits) - 1), ArgInfo("float32", 1, 1 << bits)]
        tmpl = [("D", 128), ("M", m), ("BITS", bits), ("NT", nt)]
        out.append((RESIDUAL_SKETCH_ENCODE, infos, ["uint32", nt], tmpl))
    return out


def test_encode_kernel_sources_ship_with_the_package():
    for spec in (CODEBOOK_ENCODE, RESIDUAL_SKETCH_ENCODE):
        assert_ships(spec, "velox_turboquant")


@pytest.mark.parametrize("backend", INSTANTIATIONS)
def test_encode_kernels_compile_in_each_instantiation(tmp_path, backend):
    compile_instantiation(backend, _encode_variants(), tmp_path)


@pytest.fixture(scope="module")
def codebook_encoders(tmp_path_factory):
    """One emulator program with the codebook encode kernel at 2, 3 and 4 bits."""
    emu = Emulator(tmp_path_factory.mktemp("emu_codebook"))
    handles = {}
    for bits in (2, 3, 4):
        bounds = np.asarray(lloyd_max_sphere(bits, 128).boundaries)
        handles[bits] = emu.kernel(
            CODEBOOK_ENCODE,
            [np.zeros((40, 128), np.float32), bounds],
            ["uint32"],
            [("BITS", bits), ("HD", 128)],
            sequential=True,
        )
    return emu, handles


@needs_gxx
@pytest.mark.parametrize("bits", [2, 3, 4])
def test_codebook_encode_kernel_is_bit_exact(codebook_encoders, bits):
    emu, handles = codebook_encoders
    book = lloyd_max_sphere(bits, 128)
    y = mx.random.normal((40, 128), key=mx.random.key(bits)) / math.sqrt(128)
    y[0, :8] = mx.array(np.resize(book.boundaries, 8))  # ties: x == threshold moves up
    (codes,) = emu.run(
        handles[bits],
        [np.asarray(y), np.asarray(book.boundaries)],
        [(40, -(-128 * bits // 32))],
        (40, 1, 1),
        (64, 1, 1),
    )
    assert np.array_equal(codes, np.asarray(pack(book.encode(y), bits)))


RESIDUAL_CASES = {
    # name: (code bits, sketch rows m, norm dtype)
    "2-bit codes, m 128, fp16 norms": (2, 128, mx.float16),
    "3-bit codes, m 128, bf16 norms": (3, 128, mx.bfloat16),
    "1-bit codes, m 100 (a partial word), fp32 norms": (1, 100, mx.float32),
}


@needs_gxx
@pytest.mark.parametrize("name", list(RESIDUAL_CASES))
def test_residual_sketch_encode_kernel_matches_a_float64_reference(tmp_path, name):
    """TurboQuant_prod's residual kernel: the residual is ``y - levels[code]`` with the codes
    the codebook kernel packs (so the reference's, bit for bit), its sign words are those of
    the exact (float64) ``S r`` packed as ``pack(bits, 1)`` (a partial last word's high bits
    zero), and its norm is ``||r||`` rounded to the norm dtype; the MLX reference
    (``sign_sketch`` + ``pack``) gives the same words. Mutating the residual (levels off by
    one code, another row of S) changes the words."""
    bits, m, ndt = RESIDUAL_CASES[name]
    rng = np.random.default_rng(bits * 1000 + m)
    rows, d = 2 * 3 * 21, 128
    y = rng.standard_normal((rows, d)).astype(np.float32)
    y /= np.linalg.norm(y, axis=-1, keepdims=True)
    book = lloyd_max_sphere(bits, d)
    s = rng.standard_normal((m + 5, d)).astype(np.float16)[:m]
    bounds = np.asarray(book.boundaries, np.float32)
    levels = np.asarray(book.centroids, np.float32)
    emu = Emulator(tmp_path)
    ins = [y, s, bounds, levels]
    tmpl = [("D", d), ("M", m), ("BITS", bits), ("NT", ndt)]
    handle = emu.kernel(RESIDUAL_SKETCH_ENCODE, ins, ["uint32", ndt], tmpl)
    w = -(-m // 32)
    sign, rnorm = emu.run(handle, ins, [(rows, w), (rows,)], (rows * w, 1, 1), (THREADS, 1, 1))
    codes = np.asarray(book.encode(mx.array(y))).astype(np.int64)
    r32 = y - levels[codes]  # the reference's float32 residual
    r = r32.astype(np.float64)
    sr = r @ s.astype(np.float64).T
    near = np.abs(sr) <= d * 2.0**-24 * (np.abs(r) @ np.abs(s.astype(np.float64)).T)
    assert near.mean() < 1e-3
    assert sign.shape == (rows, w) and np.array_equal(sign, sign_words(sr))
    ref = pack(sign_sketch(mx.array(r32), mx.array(s)), 1)
    assert np.array_equal(sign, np.asarray(ref))
    got = (
        rnorm.astype(np.float64)
        if ndt != mx.bfloat16
        else ((rnorm.astype(np.uint32) << 16).view(np.float32).astype(np.float64))
    )
    want = np.linalg.norm(r, axis=-1)
    # one unit of the norm's last place; float32: the sum of 128 squares' rounding
    ulp = {mx.float16: 2.0**-10, mx.bfloat16: 2.0**-7, mx.float32: 2.0**-17}[ndt]
    assert np.all(np.abs(got - want) <= ulp * want)
    # the same launch with levels one code off (a residual that is not the codes') differs
    shifted = np.roll(levels, 1)
    bad, _ = emu.run(
        handle, [y, s, bounds, shifted], [(rows, w), (rows,)], (rows * w, 1, 1), (THREADS, 1, 1)
    )
    assert not np.array_equal(bad, sign)
