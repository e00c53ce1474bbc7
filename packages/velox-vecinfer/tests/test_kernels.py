"""VecInfer's kernel path, checked on a machine without a GPU.

The decode kernel is velox-core's portable one with vector codes
(:class:`velox_vecinfer.layout.VQCodes`); here the VecInfer glue is checked: which records take
it, and, with the kernels' Metal and CUDA instantiations emulated on the CPU
(``velox_testing.emulate``), that attention through the kernel equals the codec's
reference path (keys in the smoothed, Hadamard-transformed domain against the transformed
query; values mixed from their codewords) and that a cache's fp16 window and sinks join the
codes in one softmax.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

import velox_core.kernels as vk
from velox_core import Uniform
from velox_core.cache.attention import Segment, fused_partial, joint_attention
from velox_core.kernels import decode as dk
from velox_core.kernels import portable as kport
from velox_core.kernels.build import ArgInfo
from velox_core.ops import assign, pack
from velox_testing import (
    assert_cpu_declines,
    assert_kernel_partial,
    emulated_gpu_fixture,
    kernel_env,
    kv_data,
    needs_gxx,
)
from velox_testing.emulate import EmulatedKernels, Emulator
from velox_testing.kernel_path import INSTANTIATIONS, assert_ships, compile_instantiation
from velox_vecinfer import VecInfer, VecInferCache
from velox_vecinfer.kernels import THREADS, VQ_ENCODE
from velox_vecinfer.layout import VQ, VQCodes

# (keys, values): the paper's 2 bits (256 codewords of 4 channels) on both sides; 16 pairs
# of keys (2 bits) with 256 pairs of values (4 bits); values smoothed and rotated too (the
# partial is transformed back); per-token Uniform values (a composed cache)
SETTINGS = {
    "2bit": ({}, {"smooth": False, "hadamard": False}),
    "pairs": ({"vector": 2}, {"bits": 4, "vector": 2, "smooth": False, "hadamard": False}),
    "values-transformed": ({}, {}),
    "uniform-values": ({}, None),
}


def records(name, t=256, seed=0):
    kw, vkw = SETTINGS[name]
    k, v = kv_data(t=t, seed=seed)
    kc = VecInfer(**kw, iters=4)
    vc = Uniform(2, 32) if vkw is None else VecInfer(**vkw, iters=4)
    return kc, kc.encode(k), vc, vc.encode(v)


emulated_gpu = emulated_gpu_fixture()


def test_attend_partial_is_none_on_the_cpu():
    assert_cpu_declines(*records("2bit"))


QS = (1, 2, 4, 128)


def test_kernel_sides_and_what_the_kernel_declines(monkeypatch):
    kc, kp, vc, vp = records("2bit")
    side = kc.kernel_values(kp, 128).record
    assert type(side) is VQCodes and side.kind == VQ and (side.bits, side.group) == (8, 4)
    assert side.codes is kp.data["codes"] and side.codebooks is kc.codebook is side.levels
    keys = kc.kernel_keys(kp, QS, vc.kernel_values(vp, 128).record)
    assert keys.query == kc.transform_query and keys.query_dtype == mx.float32
    assert kc.kernel_values(kp, 64) is None and kc.kernel_keys(kp, (1, 2, 4, 64), side) is None
    channel = Uniform(2, 32, axis="channel")
    cp = channel.encode(kv_data(t=256)[1])
    assert channel.kernel_values(cp, 128) is None
    assert VecInfer().kernel_values(kp, 128) is None  # not fitted
    assert kc.kernel_keys(kp, QS, channel.kernel_codes(cp)) is None  # per-channel values
    # 5-bit indices of 4 channels: a lane's indices never fill whole words (the plan declines)
    odd = VecInfer(bits=1.25, vector=4, iters=2)
    op = odd.encode(kv_data(t=256)[0])
    tk, tkp, tv, tvp = records("values-transformed")
    monkeypatch.setattr(vk, "backend", lambda: "cuda")  # a GPU as far as dispatch can tell
    called = []
    monkeypatch.setattr(dk, "decode_attention", lambda *a, **k: called.append(a) or None)
    q = mx.zeros(QS)
    assert fused_partial(q, Segment(kc, kp, channel, cp)) is None  # per-channel values
    assert not called
    vside = vc.kernel_values(vp, 128).record
    assert kport.plan_for(4, 128, odd.kernel_values(op, 128).record, vside) is None
    called.clear()
    monkeypatch.setattr(dk, "decode_attention", _real_decode_attention)
    assert fused_partial(q, Segment(odd, op, vc, vp)) is None
    # transformed values: a map back per batch row and KV head, which the one-softmax path
    # with fp16 segments declines
    assert tv.kernel_values(tvp, 128).back.shape == (1, 2, 128, 128)
    assert joint_attention(q, [Segment(tk, tkp, tv, tvp)], mx.float16, 0.1) is None
    kernel_env(monkeypatch, "VELOX_KERNELS", "0")
    assert fused_partial(q, Segment(kc, kp, vc, vp)) is None


_real_decode_attention = dk.decode_attention


@needs_gxx
@pytest.mark.parametrize("name", list(SETTINGS))
def test_emulated_kernel_attention_matches_the_reference(emulated_gpu, name):
    """The kernel's partial (the transformed query dotted with each key index's codeword,
    values mixed from theirs in the same pass) equals the codec's reference scores/mix."""
    kc, kp, vc, vp = records(name, t=300)
    q = mx.random.normal((1, 2, 4, 128), key=mx.random.key(3)) * 0.3
    assert_kernel_partial(emulated_gpu, q, kc, kp, vc, vp, 5e-5)


@needs_gxx
@pytest.mark.parametrize(
    "backend,kw",
    [
        ("metal", {"window": 32, "sinks": 4, "calibration": 64}),
        ("cuda", {"calibration": 64}),
        ("metal", {"bits": 2, "vector": 2, "window": 16, "calibration": 64}),
    ],
)
def test_emulated_cache_attends_like_the_reference(monkeypatch, tmp_path, backend, kw):
    """A VecInferCache attends through the decode kernel and the merge that joins its fp16
    window and sinks (scored against the untransformed query) in one softmax, on the
    emulated Metal and CUDA instantiations, and matches the reference cache."""
    k, v = kv_data(t=500)
    q = mx.random.normal((1, 4, 1, 128), key=mx.random.key(5)).astype(mx.float16)
    fake = EmulatedKernels(tmp_path, backend=backend).install(monkeypatch)
    cache = VecInferCache(**kw, iters=4)
    cache.update_and_fetch(k, v)
    fake.calls.clear()
    got = cache.attend(q, 0.088)
    assert fake.names == ["velox_decode_attention", "velox_decode_merge_fp16"]
    monkeypatch.setattr(vk, "backend", lambda: "cpu")  # the reference path
    ref_cache = VecInferCache(**kw, iters=4)
    ref_cache.update_and_fetch(k, v)
    ref = ref_cache.attend(q, 0.088)
    assert np.abs(np.asarray((got - ref).astype(mx.float32))).max() < 2e-3


@needs_gxx
@pytest.mark.parametrize("kw", [{}, {"bits": 3, "vector": 2}, {"bits": 1.25, "vector": 4}])
def test_emulated_encode_kernel_gives_the_reference_codes(monkeypatch, tmp_path, kw):
    """On a GPU the codec's encode runs the VQ encode kernel on the transformed vectors: the
    same words as the reference (nearest codeword by matmul, then packing), indices
    straddling words included (3 and 5 bits)."""
    k, _ = kv_data(t=200, seed=4)
    ref = VecInfer(**kw, iters=4)
    want = ref.encode(k)  # fits, then the reference path on the CPU
    got_codec = VecInfer(**kw, iters=4)
    got_codec.set_state(ref.state())
    fake = EmulatedKernels(tmp_path).install(monkeypatch)
    got = got_codec.encode(k)
    assert fake.names == ["velox_encode_vq"]
    assert np.array_equal(np.asarray(got.data["codes"]), np.asarray(want.data["codes"]))


# -- the VQ encode kernel (``metal/encode_vq.metal``, shipped by this package) -------------------


def _encode_variants():
    """The VQ encode kernel's instantiations: 256 codewords of 4 channels, 32 of 8."""
    infos = [ArgInfo("float32", 3, 1 << 20), ArgInfo("float32", 3, 1 << 16)]
    return [
        (VQ_ENCODE, infos, ["uint32"], [("BITS", bits), ("GROUP", group), ("HD", 128)])
        for bits, group in ((8, 4), (5, 8))
    ]


def test_encode_kernel_source_ships_with_the_package():
    assert VQ_ENCODE.source == "encode_vq.metal"
    assert_ships(VQ_ENCODE, "velox_vecinfer")


@pytest.mark.parametrize("backend", INSTANTIATIONS)
def test_encode_kernel_compiles_in_each_instantiation(tmp_path, backend):
    compile_instantiation(backend, _encode_variants(), tmp_path)


@needs_gxx
@pytest.mark.parametrize("bits,group", [(8, 4), (6, 2), (3, 1), (5, 8)])
def test_vq_encode_kernel_finds_the_nearest_codewords(tmp_path, bits, group):
    """The VQ encode kernel packs the index of each sub-vector's nearest codeword (its batch
    row and head's codebook) in velox's bit stream: the same words as ``assign`` + ``pack``
    (indices straddling words with 6 and 5 bits), and every index as near as the exact
    float64 nearest (no near-ties in random data)."""
    rng = np.random.default_rng(bits)
    b, h, t, d, k = 2, 2, 9, 128, 1 << bits
    y = rng.standard_normal((b, h, t, d)).astype(np.float32)
    book = rng.standard_normal((b, h, k, group)).astype(np.float32)
    words = -(-(d // group) * bits // 32)
    emu = Emulator(tmp_path)
    ins = [y.reshape(b * h, t, d), book.reshape(b * h, k, group)]
    tmpl = [("BITS", bits), ("GROUP", group), ("HD", d)]
    handle = emu.kernel(VQ_ENCODE, ins, ["uint32"], tmpl)
    n = b * h * t * words
    (codes,) = emu.run(handle, ins, [(b * h, t, words)], (n, 1, 1), (THREADS, 1, 1))
    sub = y.reshape(b * h, -1, group).astype(np.float64)
    dist = ((sub[:, :, None, :] - book.reshape(b * h, 1, k, group)) ** 2).sum(-1)
    exact = dist.argmin(-1).reshape(b, h, t, d // group)
    assert np.array_equal(codes.reshape(b, h, t, words), np.asarray(pack(mx.array(exact), bits)))
    ref = assign(mx.array(sub.astype(np.float32)), mx.array(book.reshape(b * h, k, group)))
    want = pack(ref.reshape(b, h, t, d // group), bits)
    assert np.array_equal(codes.reshape(b, h, t, words), np.asarray(want))
