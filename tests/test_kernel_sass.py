"""benchmarks/kernel_sass.py counts the tensor-core kernel's loop instructions from a
cuobjdump listing: its parser and loop finder, on a made-up listing (and the whole script
where nvcc and cuobjdump are installed)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LISTING = """
        /*0000*/                   MOV R1, c[0x0][0x28] ;       /* 0x00000a0000017a02 */
        /*0010*/                   LDS R2, [R3] ;               /* 0x0000000003027984 */
        /*0020*/                   HMMA.16816.F32 R4, R8, R12, R4 ;
        /*0030*/              @!P1 LDS.64 R2, [R3+0x10] ;
        /*0040*/                   LOP3.LUT R5, R6, 0x3, RZ, 0xc0, !PT ;
        /*0050*/                   HMMA.16816.F32 R4, R8, R12, R4 ;
        /*0060*/              @P0 BRA 0x10 ;
        /*0070*/                   EXIT ;
"""


@pytest.fixture(scope="module")
def sass(load_benchmark):
    return load_benchmark("kernel_sass")


def test_the_loop_runs_from_the_branch_target_to_the_branch(sass):
    insns = sass.parse_sass(LISTING)
    assert len(insns) == 8 and insns[2] == (0x20, "HMMA.16816.F32 R4, R8, R12, R4")
    loop = sass.main_loop(insns)
    assert [a for a, _ in loop] == [0x10, 0x20, 0x30, 0x40, 0x50, 0x60]
    assert [sass.opcode(s) for _, s in loop] == ["LDS", "HMMA", "LDS", "LOP3", "HMMA", "BRA"]
    with pytest.raises(ValueError, match="no HMMA"):
        sass.main_loop(sass.parse_sass(LISTING.replace("HMMA", "FFMA")))
    with pytest.raises(ValueError, match="no backward branch"):
        sass.main_loop(sass.parse_sass(LISTING.replace("BRA 0x10", "BRA 0x70")))


@pytest.mark.skipif(
    shutil.which("nvcc") is None or shutil.which("cuobjdump") is None,
    reason="nvcc and cuobjdump are not installed",
)
def test_the_script_counts_the_shipped_kernel():
    res = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "kernel_sass.py"), "--bits", "2"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert res.returncode == 0, res.stdout + res.stderr
    assert "main loop:" in res.stdout and "HMMA 64" in res.stdout


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not installed")
def test_both_merges_build_and_compile(sass, tmp_path):
    """The source kernel_sass.py hands nvcc, for the kernel merging its own splits and for
    the two-output kernel the library launches without the merge, compiles."""
    import argparse

    from velox_testing.emulate import shim_dir

    for merge in ("kernel", "separate"):
        args = argparse.Namespace(
            kbits=2, vbits=2, kgroup=64, vgroup=64, rows=4, dim=128, query="float16", merge=merge
        )
        src, tmpl = sass.build(args)
        assert dict(tmpl)["FUSE"] == (merge == "kernel")
        cu = tmp_path / f"{merge}.cu"
        cu.write_text(src)
        cmd = ["nvcc", "-std=c++17", "-arch=sm_90a", "-I", str(shim_dir() / "cuda"), "-c"]
        res = subprocess.run(
            [*cmd, str(cu), "-o", str(tmp_path / f"{merge}.o")], capture_output=True, text=True
        )
        assert res.returncode == 0, (merge, res.stderr[-3000:])
