"""benchmarks/gpu_decode_profile.py edits the tensor-core kernel's source to time it with a
part removed; its edits must keep matching the kernel (checked here, without a GPU) and the
edited kernels must compile (with nvcc, where installed)."""

from __future__ import annotations

import os
import shutil
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import mlx.core as mx
import pytest

from velox_core.kernels import mma_support as kmsup
from velox_core.kernels import records as krec
from velox_core.kernels.build import ArgInfo, cuda_source
from velox_testing.emulate import shim_dir

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def profile(load_benchmark):
    return load_benchmark("gpu_decode_profile")


def test_every_variant_edits_the_current_kernel(profile):
    src = profile._ORIGINAL(profile.SOURCE)
    variants = profile.make_variants(src)
    assert variants["shipped"] == src
    edited = {name: text for name, text in variants.items() if name != "shipped"}
    assert len(edited) >= 6 and all(text != src for text in edited.values())
    assert len(set(edited.values())) == len(edited)  # no two edits collapse into one
    timed = profile.timed_source(src)
    assert timed.count("%%globaltimer") == 4 and timed.count("clock64()") == 2
    assert timed.count("%%smid") == 1
    with pytest.raises(SystemExit, match="variant edit not found"):
        profile.edit(src, "no such text in the kernel", "")


def test_outlier_variants_edit_the_current_kernel(profile):
    """The outlier section's edits (no scoring loop, no value loop, neither, no butterflies,
    no barriers) still match the outlier kernel's source, each into a different text."""
    src = profile._ORIGINAL(profile.OUTLIER_SOURCE, "velox_turboquant")
    variants = profile.outlier_variants(src)
    assert variants["outlier-shipped"] == src
    edited = [text for name, text in variants.items() if name != "outlier-shipped"]
    assert len(edited) == 5 and len(set(edited)) == 5 and src not in edited
    assert variants["outlier-no-butterflies"].count("hs < 0; hs <<= 1") == 2


def test_timer_summary_reads_the_timed_words(profile):
    """The timers' words (start as two 32-bit halves, loop start, loop end, end, cycles,
    steps, SM id) become prologue / loop / epilogue times and the loop's spread by SM and row."""
    import numpy as np

    # 2 (batch, head) rows x 3 splits; SM 0 runs three threadgroups, SM 1 two, SM 2 one
    t0 = np.array([0, 100, 200, 0, 100, 50], np.int64) + (5 << 32)
    loop = np.array([3000, 4000, 5000, 2000, 2500, 1000], np.int64)
    sm = np.array([0, 0, 0, 1, 1, 2])
    words = np.zeros((6, 8), np.uint32)
    words[:, 0] = t0 & 0xFFFFFFFF
    words[:, 1] = t0 >> 32
    words[:, 2] = (t0 + 500) & 0xFFFFFFFF  # prologue 0.5 us
    words[:, 3] = (t0 + 500 + loop) & 0xFFFFFFFF
    words[:, 4] = (t0 + 700 + loop) & 0xFFFFFFFF  # epilogue 0.2 us
    w = words.view(np.float32).copy()
    w[:, 5] = loop * 1.5  # cycles: 1.5 GHz
    w[:, 6] = 10
    w[:, 7] = sm
    got = profile.timer_summary(w, 3)
    assert got["threadgroups"] == 6 and got["sms"] == 3
    assert got["prologue_us"] == 0.5 and got["epilogue_us"] == 0.2
    assert got["loop_max_us"] == 5.0 and got["loop_us"] == 2.75
    assert got["span_us"] == (200 + 700 + 5000) / 1e3
    assert abs(got["sm_ghz"] - 1.5) < 1e-6 and got["cycles_per_tile_per_warp"] == 412.5
    assert got["loop_us_by_sm_threadgroups"] == {3: 4.0, 2: 2.25, 1: 1.0}
    assert got["loop_us_by_row_pct"][0] == 2.0 and got["loop_us_by_row_pct"][-1] == 4.0


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not installed")
def test_variants_compile(profile, tmp_path):
    import dataclasses

    src = profile._ORIGINAL(profile.SOURCE)
    texts = {**profile.make_variants(src), "timed": profile.timed_source(src)}
    profile._VARIANTS.update(texts)
    old = profile.build.kernel_source
    profile.build.kernel_source = profile._kernel_source
    try:
        z = mx.zeros((1,), mx.float16)
        k = krec.AffineCodes(bits=4, group=64, codes=mx.zeros((1,), mx.uint32), scale=z, zero=z)
        infos = [ArgInfo("float16", 4, 1 << 20)]
        infos += [ArgInfo(*a) for a in (("uint32", 4, 1 << 20), *[("float16", 4, 1 << 20)] * 2)] * 2
        infos += [ArgInfo("float32", 1, 16)] * 2  # the codebook levels (dummies here)
        tmpl = kmsup.mma_template(
            128, k, k, 4, 4, 4, 1, None, mx.float16, False, True, True, mx.float16, key_fold=True
        )
        cmd = ["nvcc", "-std=c++17", "-arch=sm_90a", "-I", str(shim_dir() / "cuda"), "-c"]
        jobs = []
        for i, name in enumerate(texts):
            spec = dataclasses.replace(kmsup.mma_spec(4, 3), name=f"v{i}", source="variant:" + name)
            cu = tmp_path / f"v{i}.cu"
            cu.write_text(cuda_source(spec, infos, ["float32"], tmpl)[0])
            jobs.append((name, [*cmd, str(cu), "-o", str(tmp_path / f"v{i}.o")]))
        # one nvcc per core at a time: each compile is single-threaded
        with ThreadPoolExecutor(os.cpu_count() or 1) as pool:
            runs = pool.map(lambda j: subprocess.run(j[1], capture_output=True, text=True), jobs)
            for (name, _), res in zip(jobs, runs):
                assert res.returncode == 0, (name, res.stderr[-3000:])
    finally:
        profile.build.kernel_source = old
