"""QJL's kernel path, checked on a machine without a GPU.

The decode kernel is velox-core's portable one with sketch keys
(:class:`velox_qjl.layout.SketchCodes`); here the QJL glue is checked: which records take
it, the kernel's copy of ``S`` (its layout and its bytes), and, with the kernels' Metal and
CUDA instantiations emulated on the CPU (``velox_testing.emulate``), that attention
through the kernel equals the codec's reference path for the paper's setting, the
recommended ones and no outliers. Encoding goes through velox-core's sketch encode kernel
(``velox_core.kernels.encode.SKETCH_ENCODE``) and gives the reference's record.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess

import mlx.core as mx
import numpy as np
import pytest

import velox_core.kernels as vk
from velox_core import Uniform
from velox_core.cache import attention as att
from velox_core.cache.attention import Segment, fused_partial, partial
from velox_core.kernels import decode as dk
from velox_core.kernels.build import ArgInfo, cuda_source
from velox_qjl import METHOD, QJL, QJLCache
from velox_qjl import sketch_mma as sm
from velox_qjl.kernels import _query_sketch, encode_sketch
from velox_qjl.layout import sketch_lanes
from velox_testing import (
    assert_cpu_declines,
    assert_kernel_partial,
    assert_partials_equivalent,
    assert_step_like_reference,
    emulated_gpu_fixture,
    kernel_env,
    kv_data,
    needs_gxx,
)
from velox_testing.emulate import EmulatedKernels, shim_dir

# the paper's setting, the recommended "4-bit" keys (m = 320: shares straddling words,
# blocks of 128), 1-bit keys with 8-bit outliers, and no outliers
KEY_SETTINGS = {
    "paper": {},
    "m320": {"sketch": 320, "outlier_bits": 8, "group": 128},
    "1bit": {"bits": 1, "outlier_bits": 8, "group": 64},
    "no-outliers": {"outliers": 0},
}


def records(kw, t=256, seed=0, value_bits=2):
    k, v = kv_data(t=t, seed=seed)
    kc, vc = QJL(**kw), Uniform(value_bits, 32)
    kc.check(128, mx.float16)
    return kc, kc.encode(k), vc, vc.encode(v)


emulated_gpu = emulated_gpu_fixture()


def kernel_sides(kc, kp, vc, vp, rows):
    """The records of the segment's kernel sides for ``rows`` query rows, or None."""
    sides = att.kernel_sides(kc, kp, vc, vp, (1, 1, rows, kc.dim or 128))
    return None if sides is None else (sides[0].record, sides[1].record)


def test_attend_partial_is_none_on_the_cpu():
    assert_cpu_declines(*records({}))


def test_encode_sketch_is_none_on_the_cpu(monkeypatch):
    kc = QJL()
    kc.check(128, mx.float16)
    k = kv_data(t=32)[0]
    if mx.default_device().type != mx.DeviceType.gpu:
        assert encode_sketch(kc, k, None) is None
    monkeypatch.setattr(vk, "backend", lambda: "cuda")
    kernel_env(monkeypatch, "VELOX_KERNELS", "0")
    assert encode_sketch(kc, k, None) is None


def test_prompts_past_the_row_limit_take_the_matmul_path(monkeypatch, tmp_path):
    """The sketch encode kernel takes a block (a decode step's) and declines a prompt of more
    than ``ENCODE_KERNEL_ROWS`` (batch x head x token) rows, whose matmuls are faster."""
    from velox_qjl import kernels as qk

    kc = QJL()
    kc.check(128, mx.float16)
    k = kv_data(t=64)[0]  # 2 heads x 64 tokens = 128 rows
    fake = EmulatedKernels(tmp_path).install(monkeypatch)
    monkeypatch.setattr(qk, "ENCODE_KERNEL_ROWS", 127)
    kc.encode(k)
    assert fake.names == []
    monkeypatch.setattr(qk, "ENCODE_KERNEL_ROWS", 128)
    kc.encode(k)
    assert fake.names == ["velox_encode_sketch"]


@needs_gxx
@pytest.mark.parametrize(
    "name,dtype",
    [("paper", mx.float16), ("m320", mx.bfloat16), ("no-outliers", mx.float16)],
)
def test_emulated_encode_kernel_gives_the_reference_record(monkeypatch, tmp_path, name, dtype):
    """On a GPU ``encode`` selects the outlier channels with MLX ops and runs the sketch
    encode kernel once: the same record as the reference path (MLX matmul signs, norms),
    field for field and bit for bit. The two sum ``S x`` in different orders, so a sign could
    differ where ``|S x|`` is within float32 rounding of 0, and a norm where its float32
    value lies within rounding of a float16 / bfloat16 tie: none does on this data."""
    kw = KEY_SETTINGS[name]
    k = kv_data(t=256, seed=7, dtype=dtype)[0]
    ref = QJL(**kw).encode(k)  # the CPU: the reference path
    fake = EmulatedKernels(tmp_path).install(monkeypatch)
    got = QJL(**kw).encode(k)
    assert fake.names == ["velox_encode_sketch"]
    assert (got.tokens, got.block, got.per_block) == (ref.tokens, ref.block, ref.per_block)
    assert list(got.data) == list(ref.data)
    for field, want in ref.data.items():
        have = got.data[field]
        assert have.dtype == want.dtype and have.shape == want.shape, field
        if want.dtype == mx.bfloat16:
            have, want = have.view(mx.uint16), want.view(mx.uint16)
        assert np.array_equal(np.asarray(have), np.asarray(want)), field


def test_the_kernel_declines_what_it_does_not_lay_out(monkeypatch):
    kc, kp, vc, vp = records({})
    channel = Uniform(2, 32, axis="channel")
    cp = channel.encode(kv_data(t=256)[1])
    odd = records({"sketch": 100, "outliers": 3, "outlier_bits": 5})  # 15 outlier bits
    # layouts the plan declines make no copy of S: blocks longer than a split (4 rows: 1,024
    # tokens), or more weights a query row than registers (m = 2048, m_o = 512 at d = 256)
    long = records({"group": 2048}, t=2048)
    k256 = QJL(bits=8)
    k256.check(256, mx.float16)
    wide = (k256, k256.encode(mx.zeros((1, 2, 32, 256), mx.float16)))
    wide_v = Uniform(2, 32).encode(mx.zeros((1, 2, 32, 256), mx.float16))
    # a GPU as far as dispatch can tell (Metal: the portable kernel's plan; on CUDA the
    # tensor-core sketch kernel takes the long blocks, see the tests below)
    monkeypatch.setattr(vk, "backend", lambda: "metal")
    called = []
    monkeypatch.setattr(dk, "decode_attention", lambda *a, **k: called.append(a) or None)
    q = mx.zeros((1, 2, 4, 128))
    assert kernel_sides(kc, kp, vc, vp, 4) is not None  # (the paper's setting is taken)
    assert fused_partial(q, Segment(kc, kp, channel, cp)) is None  # per-channel values
    assert kernel_sides(*odd, 4) is None  # no lane count splits 15 outlier bits evenly
    assert fused_partial(q, Segment(*odd)) is None
    assert not called
    for codec, sides in ((long[0], long), (k256, (*wide, Uniform(2, 32), wide_v))):
        before = codec.state_nbytes
        assert kernel_sides(*sides, 4) is None
        assert codec.state_nbytes == before and not codec._kernel_mats
    kernel_env(monkeypatch, "VELOX_KERNELS", "0")
    assert kernel_sides(kc, kp, vc, vp, 4) is None


def test_kernel_matrix_is_s_in_the_lanes_order_and_counted(monkeypatch):
    """Column ``i * lanes + j`` of the kernel's matrix is row ``j * m / lanes + i`` of ``S``
    (then the outlier sketch's rows when its size differs), so ``q`` times its first ``m``
    columns is ``S q`` permuted; the copy is made once and counted in the codec's bytes."""
    for kw, cols in (({}, 256), ({"sketch": 320, "outlier_bits": 8}, 384)):
        kc = QJL(**kw)
        kc.check(128, mx.float16)
        m, k, mo = kc.sizes(128)
        lanes = sketch_lanes(m, mo)
        before = kc.state_nbytes
        mat = kc.kernel_matrix(lanes)
        assert mat.shape == (128, cols) and mat.dtype == mx.float16
        assert kc.kernel_matrix(lanes) is mat
        assert kc.state_nbytes == before + mat.nbytes
        s = np.asarray(kc.proj)
        got = np.asarray(mat)
        share = m // lanes
        for j in (0, 5, lanes - 1):
            for i in (0, share - 1):
                assert np.array_equal(got[:, i * lanes + j], s[j * share + i])
        if cols > m:
            oshare = mo // lanes
            assert np.array_equal(got[:, m + 1 * lanes + 3], s[3 * oshare + 1])
        q = mx.random.normal((1, 2, 3, 128), key=mx.random.key(1))
        k, v = kv_data(t=kc.group * 2)
        vc = Uniform(2, 32)
        kp, vp = kc.encode(k), vc.encode(v)
        with monkeypatch.context() as mp:
            mp.setattr(vk, "backend", lambda: "metal")  # so that kernel_sides applies
            keys = kernel_sides(kc, kp, vc, vp, 3)[0]
        assert keys.sketch.matrix is mat and keys.sketch.lanes == lanes
        perm = np.asarray(_query_sketch(keys, q))
        ref = np.asarray(q) @ s[:m].astype(np.float32).T
        order = [j * share + i for i in range(share) for j in range(lanes)]
        assert np.abs(perm - ref[..., order]).max() <= 1e-4 * np.abs(ref).max()


@needs_gxx
@pytest.mark.parametrize("name", list(KEY_SETTINGS))
def test_emulated_kernel_attention_matches_the_reference(emulated_gpu, name):
    """The kernel's partial (sign sketches scored against the sketched query, outlier
    blocks' ``S P q`` formed in the kernel, values mixed in the same pass) equals the codec's
    reference scores/mix path."""
    kc, kp, vc, vp = records(KEY_SETTINGS[name], t=384)
    q = mx.random.normal((1, 2, 4, 128), key=mx.random.key(3)) * 0.3
    assert_kernel_partial(emulated_gpu, q, kc, kp, vc, vp, 5e-5)


@needs_gxx
@pytest.mark.parametrize("backend,i", [("metal", 0), ("metal", 3), ("cuda", 1)])
def test_emulated_cache_attends_like_the_reference(monkeypatch, tmp_path, backend, i):
    """A QJLCache (velox-qjl's recommended settings, with sinks on one) attends through the
    decode kernel and the merge that joins its fp16 window and sinks in one softmax, on the
    emulated Metal and CUDA instantiations, and matches the reference cache."""
    kw = dict(METHOD.recommended[i])
    if i == 3:
        kw["sinks"] = 4
    k, v = kv_data(t=700)
    q = mx.random.normal((1, 4, 1, 128), key=mx.random.key(5)).astype(mx.float16)
    fake = EmulatedKernels(tmp_path, backend=backend).install(monkeypatch)
    cache, ref_cache = assert_step_like_reference(
        fake, monkeypatch, lambda: QJLCache(**kw), k, v, q, "velox_decode_attention_sketch"
    )
    # the kernel's copy of S is resident and counted, once per layer's key codec
    body = next(s for s in cache.segments() if isinstance(s.key_codec, QJL))
    assert cache.nbytes == ref_cache.nbytes + sum(
        a.nbytes for a in body.key_codec._kernel_mats.values()
    )


# -- the tensor-core sketch kernel (CUDA): decode_attention_sketch_mma.cu -------------------------

MMA_SETTINGS = {
    # name: (codec settings, value bits, query rows, tokens)
    "paper-4-rows": ({}, 2, 4, 384),
    "no-outliers-4bit-values-1-row": ({"outliers": 0}, 4, 1, 200),
    "mo-128-8bit-values": ({"bits": 3, "outlier_bits": 16, "group": 64}, 8, 3, 448),
    "16-outliers-8-rows": ({"outliers": 16, "outlier_bits": 8}, 2, 8, 256),
    # velox-qjl's recommended keys: m 320 and m_o 64 end in 64-bit parts shared by lane pairs
    "recommended-m320-mo64": (KEY_SETTINGS["m320"], 2, 4, 384),
    # m 224 = 128 + 64 + 32 and m_o 32 (a 32-bit part alone), 8 rows (residuals in own MMAs)
    "m224-mo32-8-rows": ({"sketch": 224, "outlier_bits": 4, "group": 64}, 2, 8, 256),
    # m = m_o = 384 (shared columns, too many fragments: S q's in shared memory), 2 rows
    "m384-shared-2-rows": ({"bits": 3, "outlier_bits": 48, "group": 64}, 4, 2, 256),
}


def test_sketch_mma_plans_fragments_and_loads(monkeypatch):
    """Where the B fragments go and how far ahead tiles load, per layout: the recommended keys
    (own outlier columns) take ``S q - S P q`` per block and load two tiles ahead; the paper's
    setting (shared columns) keeps ``S q``'s fragments in registers, or in shared memory at 8
    rows; the environment overrides, and rejects values it does not know."""
    assert sm.b_diff(4, 320, 64, 8) and sm.tiles_ahead(4, 320, 64, 8) == 2
    assert not sm.frags_shared(4, 320, 64, 8)
    assert not sm.b_diff(4, 256, 256, 8) and not sm.frags_shared(4, 256, 256, 8)
    assert sm.tiles_ahead(4, 256, 256, 8) == 1 and sm.frags_shared(8, 256, 256, 8)
    assert sm.b_diff(4, 384, 128, 8) and sm.tiles_ahead(4, 384, 128, 8) == 1  # 64 words
    assert not sm.b_diff(4, 256, 0, 0) and not sm.frags_shared(4, 256, 0, 0)
    kernel_env(monkeypatch, "VELOX_SKETCH_MMA_DIFF", "0")
    assert not sm.b_diff(4, 320, 64, 8) and sm.frags_shared(4, 320, 64, 8)
    assert sm.tiles_ahead(4, 320, 64, 8) == 1
    with pytest.raises(ValueError, match="VELOX_SKETCH_MMA_DIFF must be 0 or 1"):
        kernel_env(monkeypatch, "VELOX_SKETCH_MMA_DIFF", "yes")
    kernel_env(monkeypatch, "VELOX_SKETCH_MMA_DIFF", None)
    with pytest.raises(ValueError, match="VELOX_SKETCH_MMA_AHEAD must be one of 1, 2"):
        kernel_env(monkeypatch, "VELOX_SKETCH_MMA_AHEAD", "3")


def test_sketch_mma_order_is_whole_words_a_lane():
    """The tensor-core kernel's order of the sketch rows is a permutation in which lane ``t``
    of a k-step reads only words ``[t W, (t + 1) W)`` (``W = n // 128``) and, past them, the
    row's last words, which hold a 64-bit part shared by lane pairs and a 32-bit part shared
    by all four (each lane's bits a contiguous run of them); its column pairs ``(2t, 2t + 1)``
    are bits ``j`` and ``j + 16`` of one word; ``sketch_mma_matrix`` is ``S`` in that order."""
    for n in (32, 64, 96, 128, 224, 256, 320, 384):
        o = sm.order(n)
        assert sorted(o) == list(range(n))
        w, cols = n // 128, np.arange(n)
        lane_t = (cols % 16 % 8) // 2
        whole = cols // 16 < 8 * w
        assert np.array_equal(o[whole] // 32 // w, lane_t[whole])
        assert np.all(o[~whole] // 32 >= 4 * w)
        for part, first, lanes in ((64, 4 * w, 2), (32, 4 * w + 2 * (n % 128 >= 64), 4)):
            if n % (2 * part) < part:
                continue
            # the part's words: lane t's bits within them a contiguous run of 16 / lanes pairs
            at = (o // 32 >= first) & (o // 32 < first + part // 32) & ~whole
            for lt in range(4):
                bits = o[at & (lane_t == lt)]
                assert len(bits) == part // 4
                word = set(bits // 32)
                assert len(word) == 1 and word.pop() == first + lt // (4 // (part // 32))
                low = np.sort(bits % 32 % 16)
                start = (lt % lanes) * (16 // lanes)
                assert np.array_equal(np.unique(low), np.arange(start, start + 16 // lanes))
        pairs = o.reshape(-1, 2)  # columns 2c, 2c + 1
        assert np.array_equal(pairs[:, 1] - pairs[:, 0], np.full(n // 2, 16))
    with pytest.raises(ValueError, match="multiple of 32"):
        sm.order(112)
    kc = QJL(bits=3, outlier_bits=16)
    kc.check(128, mx.float16)
    m, _, mo = kc.sizes(128)
    mat = np.asarray(kc.kernel_matrix(0))
    s = np.asarray(kc.proj)
    assert mat.shape == (128, m + mo)
    assert np.array_equal(mat[:, :m], s[sm.order(m)].T)
    assert np.array_equal(mat[:, m:], s[sm.order(mo)].T)


@needs_gxx
@pytest.mark.parametrize("name", list(MMA_SETTINGS))
def test_emulated_tensor_core_kernel_matches_the_reference(monkeypatch, tmp_path, name):
    """On CUDA the tensor-core sketch kernel takes QJL keys of whole 32-bit words (the signs
    as fp16 +-1 MMA operands, each outlier block's ``S P q`` by MMAs, values mixed by MMAs;
    ``S q``'s fragments in registers or, past :data:`sm.FRAG_WORDS`, in shared memory):
    emulated lane by lane, its partial matches the codec's reference path, up to its lazy
    running max and the fp16 roundings of the weights and the decoded values."""
    kw, vbits, rows, t = MMA_SETTINGS[name]
    kc, kp, vc, vp = records(kw, t=t, value_bits=vbits)
    q = mx.random.normal((1, 2, rows, 128), key=mx.random.key(3)) * 0.3
    fake = EmulatedKernels(tmp_path, backend="cuda").install(monkeypatch)
    fake.calls.clear()
    got = fused_partial(q, Segment(kc, kp, vc, vp))
    assert fake.names == ["velox_decode_sketch_mma", "velox_decode_merge"]
    monkeypatch.setattr(vk, "backend", lambda: "cpu")
    ref = partial(q, Segment(kc, kp, vc, vp))
    assert_partials_equivalent(got, ref, 1e-3)


@needs_gxx
def test_emulated_tensor_core_kernel_takes_a_bf16_cache_and_declines_odd_sketches(
    monkeypatch, tmp_path
):
    """A bfloat16 model's QJLCache (bf16 norms, scales and zeros, fp16 window joined in the
    merge) attends through the tensor-core sketch kernel and matches the reference cache;
    sketches that are not whole 32-bit words (m = 336) keep the portable kernel, as do more
    query rows than a tile's 8, and ``VELOX_DECODE_MMA=0`` sends all to it."""
    k, v = kv_data(t=700, dtype=mx.bfloat16)
    q = mx.random.normal((1, 4, 1, 128), key=mx.random.key(5)).astype(mx.bfloat16)
    fake = EmulatedKernels(tmp_path, backend="cuda").install(monkeypatch)
    cache = QJLCache()
    cache.update_and_fetch(k, v)
    fake.calls.clear()
    got = cache.attend(q, 0.088)
    assert fake.names == ["velox_decode_sketch_mma", "velox_decode_merge_fp16"]
    kc, kp, vc, vp = records(KEY_SETTINGS["m320"], t=256)
    assert kernel_sides(kc, kp, vc, vp, 4)[0].sketch.mma is True  # the recommended keys
    kc, kp, vc, vp = records({"sketch": 336}, t=256)
    assert kernel_sides(kc, kp, vc, vp, 4)[0].sketch.mma is False
    kc, kp, vc, vp = records({}, t=256)
    assert kernel_sides(kc, kp, vc, vp, 4)[0].sketch.mma is True
    assert kernel_sides(kc, kp, vc, vp, 9)[0].sketch.mma is False  # more rows than a tile
    kernel_env(monkeypatch, "VELOX_DECODE_MMA", "0")
    assert kernel_sides(kc, kp, vc, vp, 4)[0].sketch.mma is False
    monkeypatch.setattr(vk, "backend", lambda: "cpu")  # the reference path
    ref_cache = QJLCache()
    ref_cache.update_and_fetch(k, v)
    ref = ref_cache.attend(q, 0.088)
    assert np.abs(np.asarray((got - ref).astype(mx.float32))).max() < 1e-2


def test_sketch_mma_checks_its_inputs():
    """A segment laid out for the tensor-core kernel that it does not take is an error, not a
    silent fallback with the wrong matrix; a query sketch of the wrong shape is rejected;
    norms other than fp16 and bf16 are laid out for the portable kernel."""
    kc, kp, vc, vp = records({}, t=256)
    keys = _sides_for_cuda(kc, kp, vc, vp)
    assert keys.sketch.mma
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(vk, "backend", lambda: "cuda")
        values = vc.kernel_codes(vp)
        assert sm.wanted(4, 128, 256, 256, 8, 32, mx.float16, values)
        assert not sm.wanted(4, 128, 256, 256, 8, 32, mx.float32, values)
    values = vc.kernel_codes(vp)
    q = mx.zeros((1, 2, 4, 128))
    with pytest.raises(ValueError, match="q_sketch"):
        sm.decode_sketch_mma(q, keys, values, None, None, mx.zeros((1, 2, 4, 3)))
    channel = Uniform(2, 32, axis="channel")
    cvals = channel.kernel_codes(channel.encode(kv_data(t=256)[1]))
    assert not sm.supported(4, 128, keys, cvals)
    with pytest.raises(ValueError, match="tensor-core sketch kernel"):
        dk.decode_attention(q, keys, cvals, q_sketch=_query_sketch(keys, q))


def _sides_for_cuda(kc, kp, vc, vp, rows=4):
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(vk, "backend", lambda: "cuda")
        return kernel_sides(kc, kp, vc, vp, rows)[0]


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not installed")
@pytest.mark.parametrize(
    "kw,rows",
    [({}, 4), (KEY_SETTINGS["m320"], 4), (KEY_SETTINGS["m320"], 1), ({}, 8)],
    ids=["paper", "m320", "m320-1-row", "paper-8-rows"],
)
def test_tensor_core_sketch_kernel_compiles_for_sm90_without_spills(tmp_path, kw, rows):
    """nvcc compiles the instantiations of the paper's setting (4 query rows: ``S q``'s
    fragments in registers; 8: in shared memory) and of the recommended keys (m 320, m_o 64:
    ``S q - S P q`` per block, tiles loaded two ahead; 1 row: the rows padded to 4) for
    sm_90a, as MLX compiles them: no spills, within the 48 KiB of
    static shared memory, and in at most 256 registers, so that the :data:`sm.SM_BLOCKS`
    threadgroups the split count assumes fit on one SM."""
    kc, kp, vc, vp = records(kw, t=256)
    keys, values = _sides_for_cuda(kc, kp, vc, vp, rows), vc.kernel_codes(vp)
    q = mx.zeros((1, 2, rows, 128))
    inputs = [q, _query_sketch(keys, q), keys.codes, keys.a, keys.sketch.osign, keys.b]
    inputs += [keys.sketch.idx, keys.sketch.matrix, values.codes, values.a, values.b]
    src = cuda_source(
        sm.DECODE_SKETCH_MMA,
        [ArgInfo.of(a) for a in inputs],
        ["float32", "float32"],
        sm.sketch_mma_template(128, rows, keys, values),
    )[0]
    cu = tmp_path / "sketch.cu"
    cu.write_text(src)
    inc = os.environ.get("VELOX_MLX_CUDA_INCLUDE") or str(shim_dir() / "cuda")
    cmd = ["nvcc", "-std=c++17", "-arch=sm_90a", "-Xptxas", "-v", "-I", inc, "-cubin", str(cu)]
    res = subprocess.run([*cmd, "-o", str(tmp_path / "k.cubin")], capture_output=True, text=True)
    assert res.returncode == 0, res.stderr[-4000:]
    assert re.findall(r"(\d+) bytes spill stores", res.stderr) == ["0"], res.stderr[-2000:]
    (regs,) = (int(x) for x in re.findall(r"Used (\d+) registers", res.stderr))
    (smem,) = (int(x) for x in re.findall(r"(\d+) bytes smem", res.stderr))
    assert smem <= 48 * 1024
    assert sm.SM_BLOCKS * sm.NWARPS * 32 * -(-regs // 8) * 8 <= 65536, regs
