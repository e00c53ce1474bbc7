"""RaBitQ's kernel path, checked on a machine without a GPU.

The decode kernels are velox-core's (the portable one, and the tensor-core one on CUDA for 2,
4 and 8 bits) reading RaBitQ keys as affine codes of one group a token
(:mod:`velox_rabitq.kernels`): here the glue is checked: which records take it, the layout
mapping, and, with the kernels' Metal and CUDA instantiations emulated on the CPU
(``velox_testing.emulate``), that attention through the kernels equals the codec's
reference path (scores from :meth:`velox_rabitq.RaBitQ.scores`, values mixed by ``Uniform``),
the centroid's term added per split included, for 1, 2 and 4 bits, the zero centroid and the
default one, batches of several rows, a cache's fp16 window and sinks in one softmax, and a
batch of sequences of different lengths.
"""

from __future__ import annotations

import re

import mlx.core as mx
import numpy as np
import pytest

import velox_core.kernels as vk
from velox_core import Identity, Packed, Uniform, VeloxBatch
from velox_core.cache import attention as att
from velox_core.cache.attention import Segment, fused_partial, partial
from velox_core.kernels import records as krec
from velox_core.ops import unpack
from velox_rabitq import RaBitQ, RaBitQCache
from velox_rabitq import kernels as rk
from velox_rabitq import layout as rl
from velox_rabitq.layout import BlockCodes
from velox_rabitq.quantizer import grid
from velox_testing import (
    assert_cpu_declines,
    assert_partials_close,
    assert_partials_equivalent,
    kernel_env,
    kv_data,
)
from velox_testing.emulate import emulated_or_skip

D = 128


def records(bits, centroid, b=2, t=384, value_bits=4, dtype=mx.float16, seed=0):
    k, v = kv_data(b=b, t=t, seed=seed, dtype=dtype)
    kc, vc = RaBitQ(bits, centroid), Uniform(value_bits, 64)
    return kc, kc.encode(k), vc, vc.encode(v)


def same_factors(kc, kp):
    """``kp`` with ``ip`` set to 1 and ``delta`` to ``Delta / <o_bar, o>`` rounded to
    ``11 - bits`` significant bits: then the kernel's scale is that value and its zero
    ``-scale (2^B - 1)/2`` is exact in fp16, so the reference scores with exactly the factors
    the kernel reads and the two differ only by float32 arithmetic."""
    factor = np.asarray(kp.data["delta"].astype(mx.float32) / kp.data["ip"].astype(mx.float32))
    mant, exp = np.frexp(factor)
    keep = 2.0 ** (11 - kc.bits)
    delta = mx.array(np.ldexp(np.round(mant * keep) / keep, exp)).astype(mx.float16)
    data = dict(kp.data, delta=delta, ip=mx.ones_like(delta))
    return Packed(data, kp.tokens, kp.block, kp.per_block)


def query(b=2, rows=4, seed=3):
    # logits of a few units over these keys (their shared offset makes q . c the larger part)
    return mx.random.normal((b, 2, rows, D), key=mx.random.key(seed)) * 0.1


@pytest.fixture(scope="module")
def emu_dir(tmp_path_factory):
    """One emulator folder for the module: an instantiation is compiled once."""
    return tmp_path_factory.mktemp("rabitq-emulator")


def kernel_sides(kc, kp, vc, vp, rows=4):
    """The segment's kernel sides for ``rows`` query rows, or None (the reference path)."""
    return att.kernel_sides(kc, kp, vc, vp, (kp.data["codes"].shape[0], 2, rows, D))


def attend_partial(kc, q, kp, vc, vp):
    return fused_partial(q, Segment(kc, kp, vc, vp))


def test_attend_partial_is_none_on_the_cpu():
    assert_cpu_declines(*records(4, 128), q_shape=(2, 2, 4, D))


@pytest.mark.parametrize("bits", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("dtype", [mx.float16, mx.bfloat16])
def test_kernel_keys_are_the_scaled_grid(bits, dtype):
    """The kernel's view reads the record's own words as ``bits``-bit affine codes of one
    group of ``D`` channels, and ``scale * u + zero`` is ``Delta / <o_bar, o> * y``, the
    reference's residual key in the rotated domain, up to the scale's rounding to fp16 (and
    the zero's), for fp16 and bf16 records alike."""
    kc, kp, _, _ = records(bits, 64, b=1, t=128, dtype=dtype)
    c = rk.affine_codes(kc, kp)
    assert (c.kind, c.bits, c.group) == (krec.AFFINE, bits, D)
    assert c.codes is kp.data["codes"]
    assert c.a.shape == c.b.shape == (1, 2, 128, 1) and c.a.dtype == c.b.dtype == mx.float16
    u = unpack(kp.data["codes"], bits, D).astype(mx.float32)
    got = np.asarray(c.a.astype(mx.float32) * u + c.b.astype(mx.float32))
    factor = kp.data["delta"].astype(mx.float32) / kp.data["ip"].astype(mx.float32)
    want = np.asarray(factor[..., None] * grid(u, bits))
    eps = 2.0**-11  # the scale's and zero's rounding to fp16 (a bf16 record's too)
    tol = eps * ((1 << bits) - 1) * np.asarray(factor)[..., None]
    assert np.all(np.abs(got - want) <= tol)
    assert np.abs(got - want).max() > 0  # (the rounding is real: the bound is not vacuous)


def test_which_records_take_the_kernel(monkeypatch, emu_dir):
    """Records the kernels take, and those that go to the reference path without launching
    anything: values that are not per-token ``Uniform`` codes, a codec not bound to a head
    dim, kernels off, and centroid blocks longer than a split of the portable kernel (4,096
    tokens over its query rows a pass: 2 or 4 for 4 rows here), which only the tensor-core
    kernel takes (2, 4, 8 bits, CUDA)."""
    kc, kp, vc, vp = records(4, 128)
    q = query()
    fake = emulated_or_skip(monkeypatch, emu_dir)
    assert kernel_sides(kc, kp, vc, vp) is not None
    channel = Uniform(4, 32, axis="channel")
    assert attend_partial(kc, q, kp, channel, channel.encode(kv_data(b=2, t=384)[1])) is None
    ident = Identity()
    assert attend_partial(kc, q, kp, ident, ident.encode(kv_data(b=2, t=384)[1])) is None
    assert attend_partial(RaBitQ(), q, kp, vc, vp) is None  # no head dim yet
    assert attend_partial(kc, q[..., :64], kp, vc, vp) is None  # another head dim
    for bits in (4, 1):
        lk, lkp, lvc, lvp = records(bits, 4096, b=1, t=4096)
        assert kernel_sides(lk, lkp, lvc, lvp, rows=4) is None
        assert attend_partial(lk, query(b=1), lkp, lvc, lvp) is None
        with monkeypatch.context() as mp:
            mp.setattr(vk, "backend", lambda: "cuda")
            sides = kernel_sides(lk, lkp, lvc, lvp, rows=4)
            assert (sides is not None) == (bits == 4)
            if sides is not None:
                assert type(sides[0].record) is BlockCodes and sides[0].record.block == 4096
    assert not [n for n in fake.names if n.startswith("velox_decode")]
    kernel_env(monkeypatch, "VELOX_KERNELS", "0")
    assert kernel_sides(kc, kp, vc, vp) is None
    assert attend_partial(kc, q, kp, vc, vp) is None


# the kernels' names as launched (the tensor-core kernel's carry its register bound)
PORTABLE = "velox_decode_attention"
MMA_PARTS = r"velox_decode_attention_mma_parts(_lb\d+x\d+)?"  # splits merged by a second launch
MMA_FUSED = r"velox_decode_attention_mma(_lb\d+x\d+)?"  # merging its own splits
MERGE = "velox_decode_merge"
MERGE_FP16 = "velox_decode_merge_fp16"


@pytest.mark.parametrize("backend", ["metal", "cuda"])
@pytest.mark.parametrize("centroid", [0, 128])
@pytest.mark.parametrize("bits", [1, 2, 4])
def test_emulated_kernel_equals_the_reference(monkeypatch, emu_dir, backend, centroid, bits):
    """On the same factors (:func:`same_factors`) the kernel's partial (the rotated query
    against the codes, one split per centroid block with the block's ``<q, c>`` added to its
    max, values mixed in the same pass, the splits merged) equals the reference scores/mix
    path: to float32 rounding on the portable kernel, and up to the tensor-core kernel's lazy
    running max and fp16 weights. Two batch rows, three centroid blocks."""
    kc, kp, vc, vp = records(bits, centroid)
    kp = same_factors(kc, kp)
    q = query()
    ref = partial(q, Segment(kc, kp, vc, vp))
    fake = emulated_or_skip(monkeypatch, emu_dir, backend)
    got = attend_partial(kc, q, kp, vc, vp)
    tensor_core = backend == "cuda" and bits in (2, 4)
    assert len(fake.names) == 2 and fake.names[1] == MERGE
    assert re.fullmatch(MMA_PARTS if tensor_core else PORTABLE, fake.names[0]), fake.names
    if tensor_core:
        assert_partials_equivalent(got, ref, 2e-3)
    else:
        assert_partials_close(got, ref, 1e-4)


def _normalized(part):
    o, _, l = part
    return np.asarray(o / l)


@pytest.mark.parametrize("bits", [1, 4])
def test_emulated_kernel_on_the_records_and_without_the_centroid_term(monkeypatch, emu_dir, bits):
    """On the records themselves the kernel's attention differs from the reference by the
    rounding of its scale ``Delta / <o_bar, o>`` and zero to fp16 (below 1e-2 of the output
    here); without the centroid term it is off by more than five times that: the checks see
    the term."""
    kc, kp, vc, vp = records(bits, 128)
    q = query()
    ref = _normalized(partial(q, Segment(kc, kp, vc, vp)))
    emulated_or_skip(monkeypatch, emu_dir)
    got = _normalized(attend_partial(kc, q, kp, vc, vp))
    tol = 1e-2
    assert np.abs(got - ref).max() / np.abs(ref).max() < tol
    monkeypatch.setattr(
        rl, "_centroid_bias", lambda q, ct, f: mx.zeros((*q.shape[:2], ct.shape[-1], q.shape[2], 1))
    )
    off = _normalized(attend_partial(kc, q, kp, vc, vp))
    assert np.abs(off - ref).max() / np.abs(ref).max() > 5 * tol


CACHES = {
    # name: (backend, model dtype, cache settings, the kernels a decode step launches)
    "default-metal": ("metal", mx.float16, {}, (PORTABLE, MERGE_FP16)),
    "default-cuda-bf16-sinks": ("cuda", mx.bfloat16, {"sinks": 4}, (MMA_PARTS, MERGE_FP16)),
    "1bit-window-sinks-cuda": (
        "cuda",
        mx.float16,
        {"key_bits": 1, "value_bits": 4, "centroid": 32, "window": 64, "sinks": 4},
        (PORTABLE, MERGE_FP16),
    ),
    # every token coded (no fp16 tokens): the tensor-core kernel merges its splits itself
    "2bit-zero-centroid-cuda": ("cuda", mx.float16, {"bits": 2, "centroid": 0}, (MMA_FUSED,)),
    "3bit-zero-centroid-metal": (
        "metal",
        mx.float16,
        {"bits": 3, "centroid": 0},
        (PORTABLE, MERGE_FP16),
    ),
    "4bit-zero-centroid-window-cuda": (
        "cuda",
        mx.float16,
        {"bits": 4, "centroid": 0, "window": 16},
        (MMA_PARTS, MERGE_FP16),
    ),
}


@pytest.mark.parametrize("name", list(CACHES))
def test_emulated_cache_attends_like_the_reference(monkeypatch, emu_dir, name):
    """A RaBitQCache attends a decode step through the decode kernel and the merge that joins
    its fp16 window and sinks (scored against the unrotated query) in one softmax, on the
    emulated Metal and CUDA instantiations, and matches the reference cache (up to the
    kernel's fp16 scale and zero)."""
    backend, dtype, kw, kernels = CACHES[name]
    k, v = kv_data(t=700, dtype=dtype)
    q = (mx.random.normal((1, 4, 1, D), key=mx.random.key(5)) * 0.8).astype(dtype)
    fake = emulated_or_skip(monkeypatch, emu_dir, backend)
    cache = RaBitQCache(**kw)
    cache.update_and_fetch(k, v)
    fake.calls.clear()
    got = cache.attend(q, 0.088)
    assert len(fake.names) == len(kernels), fake.names
    assert all(re.fullmatch(w, n) for n, w in zip(fake.names, kernels)), fake.names
    monkeypatch.setattr(vk, "backend", lambda: "cpu")  # the reference path
    ref_cache = RaBitQCache(**kw)
    ref_cache.update_and_fetch(k, v)
    ref = ref_cache.attend(q, 0.088)
    err = np.abs(np.asarray((got - ref).astype(mx.float32))).max()
    assert err < (2e-2 if dtype == mx.bfloat16 else 5e-3), err


def test_emulated_batch_of_different_lengths_attends_like_each_sequence(monkeypatch, emu_dir):
    """Sequences of 700 and 450 tokens in one batch (velox-core keeps them as two groups,
    attended one after the other: the kernels take one length per launch) attend through the
    kernel path like each sequence's own reference cache."""
    k1, v1 = kv_data(t=700, seed=1)
    k2, v2 = kv_data(t=450, seed=2)
    q = (mx.random.normal((2, 4, 1, D), key=mx.random.key(6)) * 0.8).astype(mx.float16)
    fake = emulated_or_skip(monkeypatch, emu_dir)
    caches = [RaBitQCache(), RaBitQCache()]
    caches[0].update_and_fetch(k1, v1)
    caches[1].update_and_fetch(k2, v2)
    batch = VeloxBatch.merge(caches)
    assert len(batch.groups) == 2
    fake.calls.clear()
    got = batch.attend(q, 0.088)
    assert fake.names == [PORTABLE, MERGE_FP16] * 2
    monkeypatch.setattr(vk, "backend", lambda: "cpu")
    for row, (k, v) in enumerate(((k1, v1), (k2, v2))):
        ref_cache = RaBitQCache()
        ref_cache.update_and_fetch(k, v)
        ref = ref_cache.attend(q[row : row + 1], 0.088)
        err = np.abs(np.asarray((got[row : row + 1] - ref).astype(mx.float32))).max()
        assert err < 5e-3, (row, err)
