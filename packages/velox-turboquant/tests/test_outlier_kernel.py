"""The outlier kernel's host side (TurboQuant's fractional widths), checked without a GPU.

The kernel (``metal/decode_attention_outlier.metal``, shipped by this package) places and
rotates the query per group of tokens, scores both rotated parts' codes and mixes the values
in their parts' domain; :mod:`velox_turboquant.outlier` lays it out. Here: the host side's
checks and layout, its setting (``VELOX_OUTLIER_THREADS``), and the kernel compiled through
the C++ shim of Metal (and nvcc, where installed). Its result against the reference path is
``test_kernels.py``'s (the emulated instantiation) and the GPU tests'.
"""

from __future__ import annotations

import dataclasses

import mlx.core as mx
import numpy as np
import pytest

from velox_core.kernels.build import ArgInfo, cuda_source
from velox_testing import compile_cuda, kernel_env, needs_nvcc
from velox_testing.kernel_path import INSTANTIATIONS, compile_instantiation
from velox_turboquant import outlier as ok

F32, U32 = ("float32", 4, 1 << 20), ("uint32", 4, 1 << 20)


def test_outlier_kernel_inputs_are_checked(monkeypatch):
    """The outlier kernel's host side refuses what it cannot read, with what was wrong."""
    part = ok.RotatedPart(4, 64, np.zeros(16), np.ones(64), None, 64)
    with pytest.raises(ValueError, match="power of two"):
        ok.side_table((dataclasses.replace(part, block=48),))
    with pytest.raises(ValueError, match="16 levels"):
        ok.side_table((dataclasses.replace(part, levels=np.zeros(8)),))
    table = ok.side_table((part, dataclasses.replace(part, bits=3, levels=np.zeros(8))))
    assert table.shape == (4 * 64 + 16 + 8,)
    lo = dataclasses.replace(part, bits=3, levels=np.zeros(8))
    codes = (mx.zeros((1, 2, 64, 8), mx.uint32), mx.zeros((1, 2, 64, 6), mx.uint32))
    norms = (mx.zeros((1, 2, 64), mx.float16),) * 2
    mask = mx.zeros((1, 2, 1, 4), mx.uint32)
    side = ok.OutlierSide((part, lo), codes, norms, mask, 64, table)
    q = mx.zeros((1, 2, 4, 128))
    bad = dataclasses.replace(side, mask=mx.zeros((1, 2, 2, 4), mx.uint32))
    with pytest.raises(ValueError, match="mask must be"):
        ok.decode_attention_outlier(q, side, bad)
    bad = dataclasses.replace(side, codes=(codes[0], codes[0]))
    with pytest.raises(ValueError, match="3-bit part"):
        ok.decode_attention_outlier(q, bad, side)
    short = dataclasses.replace(side, codes=tuple(c[:, :, :40] for c in codes))
    with pytest.raises(ValueError, match="whole groups"):
        ok.decode_attention_outlier(q, short, short)
    # no side with a mask, or sides with two groups: another kernel's layout, None
    one = ok.OutlierSide((dataclasses.replace(part, channels=128),), (), (), None, 1, table)
    assert ok.outlier_launch(4, 128, one, one) is None
    assert ok.outlier_launch(4, 128, side, dataclasses.replace(side, group=32)) is None
    assert ok.outlier_launch(4, 128, side, side) == (4, 16, 64, 64)
    assert ok.outlier_launch(4, 128, side, side, threads=128) == (4, 16, 64, 128)
    with pytest.raises(ValueError, match="VELOX_OUTLIER_THREADS must be one of"):
        kernel_env(monkeypatch, "VELOX_OUTLIER_THREADS", "96")
    with pytest.raises(ValueError, match="VELOX_OUTLIER_THREADS must be an integer"):
        kernel_env(monkeypatch, "VELOX_OUTLIER_THREADS", "many")
    with pytest.raises(ValueError, match="threads must be one of"):
        ok.outlier_launch(4, 128, side, side, threads=32)


def test_the_thread_setting_is_read_once_and_configurable(monkeypatch):
    kernel_env(monkeypatch, "VELOX_OUTLIER_THREADS", None)
    assert ok.OutlierConfig.current() == ok.OutlierConfig() and ok.outlier_threads() == ok.THREADS
    monkeypatch.setenv("VELOX_OUTLIER_THREADS", "128")  # read once: not seen until re-read
    assert ok.outlier_threads() == ok.THREADS
    assert kernel_env(monkeypatch, "VELOX_OUTLIER_THREADS", "128") == ok.OutlierConfig(128)
    assert ok.outlier_threads() == 128
    with ok.OutlierConfig.configured(threads=64):
        assert ok.outlier_threads() == 64
    assert ok.outlier_threads() == 128
    with pytest.raises(ValueError, match="OutlierConfig.threads must be one of 64, 128, got 32"):
        ok.OutlierConfig(32)


def test_outlier_layout_is_worked_out_once_per_shape(monkeypatch):
    """A decode step asks every layer for the same launch and template: they are worked out
    once per shape, scale and threadgroup size, and again when any of them changes."""
    kernel_env(monkeypatch, "VELOX_OUTLIER_THREADS", None)
    part = ok.RotatedPart(4, 64, np.zeros(16), np.ones(64), None, 64)
    lo = dataclasses.replace(part, bits=3, levels=np.zeros(8))
    side = ok.OutlierSide((part, lo), (), (), mx.zeros((1,)), 64, None)
    real, calls = ok.outlier_launch, []

    def counted(*a, **kw):
        calls.append(a)
        return real(*a, **kw)

    monkeypatch.setattr(ok, "outlier_launch", counted)
    ok._LAYOUTS.clear()
    first = ok._layout(4, 128, side, side, 0.088)
    assert ok._layout(4, 128, side, side, 0.088) is first and len(calls) == 1
    assert first[0] == real(4, 128, side, side) == (4, 16, 64, 64)
    assert first[1] == ok.outlier_template(first[0], 128, side, side, 0.088)
    assert ok._layout(4, 128, side, side, 0.1)[1] != first[1] and len(calls) == 2  # QMUL
    kernel_env(monkeypatch, "VELOX_OUTLIER_THREADS", "128")
    assert ok._layout(4, 128, side, side, 0.088)[0] == (4, 16, 64, 128)
    other = dataclasses.replace(side, group=32)
    assert ok._layout(4, 128, other, other, 0.088)[0][2] == 32
    one = ok.OutlierSide((dataclasses.replace(part, channels=128),), (), (), None, 1, None)
    assert ok._layout(4, 128, one, one, 0.088) == (None, None) and len(calls) == 5


def _variants():
    """The kernel as the host lays it out: channels split per group into outliers and the
    rest, both sides or one, fp16 and bf16 norms, two threadgroup sizes."""
    out = []
    for parts_k, parts_v, m_rows, norm, nt in (
        (((64, 4, 64), (64, 3, 64)), ((64, 4, 64), (64, 3, 64)), 4, "float16", 64),  # 3.5 bits
        (((64, 3, 64), (64, 2, 64)), ((128, 4, 128),), 8, "bfloat16", 64),  # 2.5 / 4-bit
        (((32, 4, 32), (96, 3, 32)), ((32, 4, 32), (96, 3, 32)), 1, "float16", 64),  # 3.25
        # threadgroups of four warps (VELOX_OUTLIER_THREADS=128)
        (((64, 4, 64), (64, 3, 64)), ((64, 4, 64), (64, 3, 64)), 4, "float16", 128),
        (((64, 3, 64), (64, 2, 64)), ((64, 3, 64), (64, 2, 64)), 8, "bfloat16", 128),
    ):
        sides = []
        for parts in (parts_k, parts_v):
            rp = tuple(ok.RotatedPart(bits, n, None, None, None, blk) for n, bits, blk in parts)
            sides.append(
                ok.OutlierSide(rp, (), (), mx.zeros((1,)) if len(rp) == 2 else None, 64, None)
            )
        launch = ok.outlier_launch(m_rows, 128, *sides, threads=nt)
        assert launch is not None and launch[3] == nt
        n16 = (norm, 3, 1 << 20)
        infos = [ArgInfo(*F32)]
        for side in sides:
            if side.mask is not None:
                infos += [ArgInfo(*a) for a in (U32, n16, U32, n16, U32, ("float32", 1, 1024))]
            else:
                small = [("uint32", 1, 8), ("float16", 1, 8)]  # the unused-input dummies
                infos += [ArgInfo(*a) for a in (small[0], small[1], U32, n16, small[0])]
                infos += [ArgInfo("float32", 1, 1024)]
        tmpl = ok.outlier_template(launch, 128, *sides, 0.088)
        out.append((ok.outlier_spec(nt), infos, ["float32"] * 2, tmpl))
    return out


def test_the_kernel_ships_with_this_package():
    spec = ok.outlier_spec(64)
    assert spec.package == "velox_turboquant" and spec.cuda_launch_bounds == (64, 8)
    assert "vx_" in spec.body("metal")


@pytest.mark.parametrize("backend", INSTANTIATIONS)
def test_the_kernel_compiles_in_each_instantiation(tmp_path, backend):
    """Through the C++ shim of Metal, and through nvcc for sm_90a without register spills,
    each threadgroup size's build in a unit of its own (a kernel with launch bounds
    re-defines ``__global__``)."""
    compile_instantiation(backend, _variants(), tmp_path, unit_each=True)


@needs_nvcc
def test_the_kernel_compiles_in_the_cuda_instantiation(tmp_path):
    """nvcc compiles each threadgroup size's build for sm_90a without register spills (a
    kernel with launch bounds re-defines ``__global__``: one unit each)."""
    compile_cuda([[cuda_source(*v)[0]] for v in _variants()], tmp_path)
