"""VecInfer's vector codes as velox-core's portable decode kernel reads them
(:mod:`velox_vecinfer.layout`): the record, its registered layout, which shapes the plan
takes, the kernel's instantiations and, emulated on the CPU, its partial against NumPy."""

from __future__ import annotations

import dataclasses

import mlx.core as mx
import numpy as np
import pytest

import velox_core.kernels as vk
from velox_core.kernels import layout as klayout
from velox_core.kernels import portable as kport
from velox_core.kernels import records as krec
from velox_core.kernels.build import ArgInfo
from velox_core.ops import pack
from velox_testing import assert_partials_close, needs_gxx
from velox_testing.emulate import DecodeRun, Emulator
from velox_testing.kernel_path import INSTANTIATIONS, compile_instantiation
from velox_vecinfer.layout import VQ, VQCodes, VQLayout

U32 = mx.zeros((1, 1, 4, 16), mx.uint32)
LEV = mx.zeros((16,), mx.float32)
F16 = mx.zeros((1,), mx.float16)


def test_the_record_builds_by_keyword_and_reads_as_vector_codes():
    rec = VQCodes(bits=8, group=4, codes=U32, codebooks=LEV)
    assert isinstance(rec, krec.CodeRecord) and rec.kind == VQCodes.kind == VQ
    assert rec.codes is U32 and rec.codebooks is LEV and rec.levels is LEV
    assert rec.a is None and rec.b is None and rec.signs is None and rec.symmetric is False
    assert not hasattr(rec, "__dict__")  # slots: no stray attributes
    with pytest.raises(TypeError):
        VQCodes(8, 4, U32, LEV)  # keyword only
    assert dataclasses.replace(rec).kind == VQ


def test_bad_records_are_refused_when_built():
    kw = dict(bits=8, group=4, codes=U32, codebooks=LEV)
    with pytest.raises(ValueError, match="VQCodes: group must be a positive int, got 0"):
        VQCodes(**{**kw, "group": 0})
    with pytest.raises(ValueError, match="VQCodes: bits must be an int from 1 to 8"):
        VQCodes(**{**kw, "bits": 9})
    for name in ("codes", "codebooks"):
        with pytest.raises(ValueError, match=f"VQCodes: {name} is required"):
            VQCodes(**{**kw, name: None})
        with pytest.raises(TypeError, match=f"{name} must be an mx.array, got list"):
            VQCodes(**{**kw, name: [0, 1]})
    with pytest.raises(TypeError, match="symmetric"):  # vector codes carry no such part
        VQCodes(**kw, symmetric=True)
    with pytest.raises(TypeError, match="scale"):
        VQCodes(**kw, scale=F16)


def test_the_layout_is_registered_for_the_record():
    rec = VQCodes(bits=8, group=4, codes=U32, codebooks=LEV)
    lay = klayout.layout_of(rec)
    assert type(lay) is VQLayout and klayout.layout_for(VQ) is lay and lay.name == "vq"
    assert klayout.register_layout(VQLayout()) is lay  # again: a no-op


def _vq_side(rng, b, h, t, d, bits, group, spread=1.0):
    """Random VQ codes and codebooks (one per batch row and KV head) and the vectors they
    stand for, float64."""
    k = 1 << bits
    idx = rng.integers(0, k, size=(b, h, t, d // group))
    book = (rng.standard_normal((b, h, k, group)) * spread).astype(np.float16)
    bi, hi = np.arange(b)[:, None, None, None], np.arange(h)[None, :, None, None]
    vec = book.astype(np.float64)[bi, hi, idx]  # (B, H, T, S, G)
    side = VQCodes(
        bits=bits,
        group=group,
        codes=pack(mx.array(idx.astype(np.int32)), bits),
        codebooks=mx.array(book),
    )
    return side, vec.reshape(b, h, t, d)


@needs_gxx
@pytest.mark.parametrize(
    "kbits,kgroup,vbits,vgroup,rows,pad,splits",
    [
        (8, 4, 8, 4, 4, 0, 3),  # the 2-bit setting: 256 codewords of 4 channels
        (4, 2, 8, 2, 1, 5, 4),  # 16 pairs keys (2 bits), 256 pairs values (4 bits)
        (6, 2, 3, 1, 8, 3, 2),  # indices straddling words, 8 query rows in blocks
        (2, 1, 4, 2, 2, 0, 5),  # scalar codebooks of their own per head (group 1)
    ],
)
def test_decode_kernel_reads_vq_codes(tmp_path, kbits, kgroup, vbits, vgroup, rows, pad, splits):
    """Each sub-vector's index reads a codeword of its (batch row, KV head)'s codebook, for
    keys and values, against a numpy reference (two batch rows with different codebooks;
    strided slices with garbage beyond when ``pad``)."""
    rng = np.random.default_rng(kbits * 10 + vbits)
    b, h, t, d = 2, 2, 400, 128
    keys, kx = _vq_side(rng, b, h, t, d, kbits, kgroup, 0.4)
    vals, vx = _vq_side(rng, b, h, t, d, vbits, vgroup)
    q = rng.standard_normal((b, h, rows, d)).astype(np.float32) * 0.3
    assert kport.plan_for(rows, d, keys, vals) is not None
    got = DecodeRun(Emulator(tmp_path), mx.array(q), keys, vals, splits=splits, pad=pad)()
    sc = np.einsum("bhmd,bhtd->bhmt", q.astype(np.float64), kx)
    mref = sc.max(axis=-1, keepdims=True)
    p = np.exp(sc - mref)
    assert_partials_close(got, (p @ vx, mref, p.sum(axis=-1, keepdims=True)), 5e-5)


def test_vq_codes_layout_rules_and_bad_input(monkeypatch):
    """The plan takes VQ codes whose lane holds whole sub-vectors and whole index words and
    whose codebook fits threadgroup memory; malformed records are refused."""
    affine = krec.AFFINE
    ok = kport.plan(4, 128, VQ, 8, 4, affine, 4, 64)
    assert ok is not None and (ok.cpl // 4 * 8) % 32 == 0
    assert kport.plan(4, 128, VQ, 8, 8, affine, 4, 64) is None  # 2,048 floats: too large
    assert kport.plan(4, 128, VQ, 8, 3, affine, 4, 64) is None  # 3 channels a sub-vector
    assert kport.plan(4, 128, affine, 4, 64, VQ, 9, 1) is None  # 9-bit indices
    assert kport.side_ok(VQ, 5, 4, 128, 16) is False  # 4 x 5 bits: not whole words
    assert kport.side_ok(VQ, 5, 4, 128, 32) is False  # 8 x 5 = 40 bits
    assert kport.side_ok(VQ, 4, 2, 128, 16) is True
    rng = np.random.default_rng(0)
    keys, _ = _vq_side(rng, 1, 2, 64, 128, 8, 4)
    vals, _ = _vq_side(rng, 1, 2, 64, 128, 8, 4)
    q = mx.zeros((1, 2, 4, 128))
    monkeypatch.setattr(vk, "backend", lambda: "metal")
    for bad, msg in (
        (dataclasses.replace(keys, codebooks=keys.codebooks[:, :, :128]), "codebooks"),
        (dataclasses.replace(keys, codes=keys.codes[..., :4]), "VQ codes"),
        (dataclasses.replace(keys, codebooks=keys.codebooks.astype(mx.int32)), "codebooks"),
    ):
        with pytest.raises(ValueError, match=msg):
            kport.plan_portable(q.shape, bad, vals, None, None)(q, None)
    with pytest.raises(ValueError, match="codebooks is required"):  # refused when built
        dataclasses.replace(keys, codebooks=None)


def _decode_variants():
    """The portable kernel's instantiations for vector codes: 256 codewords of 4 channels on
    both sides, and 16 pairs of keys beside them."""
    u32, f32, dummy = ("uint32", 4, 1 << 20), ("float32", 4, 1 << 20), ("float32", 1, 8)
    out = []
    for kb, kg, vb, vg in ((8, 4, 8, 4), (4, 2, 8, 4)):
        kside = VQCodes(bits=kb, group=kg, codes=U32, codebooks=F16)
        vside = VQCodes(bits=vb, group=vg, codes=U32, codebooks=F16)
        p = kport.plan_for(4, 128, kside, vside)
        ins = [u32, ("float16", 1, 8), ("float16", 1, 8), ("float32", 1, 1 << 16)]
        infos = [ArgInfo(*a) for a in [f32, *ins, *ins]] + [ArgInfo(*dummy)] * 5
        out.append((kport.DECODE, infos, ["float32"] * 2, kport.template(p, 128, kside, vside)))
    return out


@pytest.mark.parametrize("backend", INSTANTIATIONS)
def test_decode_kernel_compiles_for_vq_codes(tmp_path, backend):
    compile_instantiation(backend, _decode_variants(), tmp_path)
