"""NVRTC in a worker process (``kernels/nvrtc.py``): the worker imports only the standard
library, reports its failures, and gives what a compile in this process gives; ``compile_cuda``
sends a compile to a worker or keeps it here as ``KernelConfig.compile_processes`` says.

The comparison of a real compile runs where an NVRTC library loads (a CUDA machine, or
``pip install nvidia-cuda-nvrtc-cu12``, which compiles without a GPU); elsewhere it is skipped.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

from velox_core.kernels import disk_cache, nvrtc
from velox_core.kernels.config import configured

SOURCE = 'extern "C" __global__ void velox_probe(float* x) { x[threadIdx.x] *= 2.0f; }\n'
OPTIONS = ("--device-as-default-execution-space", "--gpu-architecture=sm_90a")


def test_the_worker_imports_only_the_standard_library():
    tree = ast.parse(Path(nvrtc.__file__).read_text())
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            assert node.level == 0, "the worker runs as a script: no relative imports"
            names.add(node.module.split(".")[0])
    assert names <= set(sys.stdlib_module_names), sorted(names - set(sys.stdlib_module_names))


def test_a_worker_that_cannot_load_nvrtc_says_so():
    job = nvrtc.Job(SOURCE, "velox_probe", "probe.cu", OPTIONS, {}, True)
    fields = {**job.__dict__, "options": list(OPTIONS)}
    run = subprocess.run(
        [sys.executable, "-I", "-S", nvrtc.__file__],
        input=json.dumps({"library": "libno-such-nvrtc.so", "job": fields}).encode(),
        capture_output=True,
        timeout=60,
        check=False,
    )
    assert run.returncode == 1 and run.stdout == b""
    assert b"OSError" in run.stderr and b"libno-such-nvrtc.so" in run.stderr
    with pytest.raises(RuntimeError, match="NVRTC worker for velox_probe failed.*OSError"):
        nvrtc.compile_in_worker("libno-such-nvrtc.so", job)


def _library() -> str:
    try:
        return nvrtc.load()[1]
    except OSError:
        pytest.skip("no NVRTC library loads here")


@pytest.mark.parametrize("cubin", [True, False])
def test_a_worker_compiles_what_this_process_compiles(cubin):
    library = _library()
    lib, _ = nvrtc.load()
    headers = {"velox/unused.cuh": b"#define VELOX_UNUSED 1\n"}
    job = nvrtc.Job(SOURCE, "velox_probe", "probe.cu", OPTIONS, headers, cubin)
    here = nvrtc.compile_program(lib, job)
    there = nvrtc.compile_in_worker(library, job)
    assert there == here and here[1] == "velox_probe" and len(here[0]) > 100
    broken = nvrtc.Job(SOURCE + "syntax error;", *list(job.__dict__.values())[1:])
    with pytest.raises(RuntimeError, match="NVRTC failed on velox_probe"):
        nvrtc.compile_in_worker(library, broken)


@pytest.mark.parametrize("processes", [True, False])
def test_compile_cuda_runs_where_the_configuration_says(monkeypatch, processes):
    calls = []

    def fake(where):
        def run(*args):
            calls.append((where, args))
            return b"binary", "mangled"

        return run

    monkeypatch.setattr(disk_cache, "_nvrtc", lambda: ("lib", "libnvrtc-test.so"))
    monkeypatch.setattr(disk_cache, "_compute_capability", lambda ordinal: (9, 0))
    monkeypatch.setattr(disk_cache, "_include_args", lambda: ("--include-path=/x",))
    monkeypatch.setattr(disk_cache, "_utils_standin", lambda: b"standin")
    monkeypatch.setattr(nvrtc, "version", lambda lib: (12, 9))
    monkeypatch.setattr(nvrtc, "compile_in_worker", fake("worker"))
    monkeypatch.setattr(nvrtc, "compile_program", fake("here"))
    with configured(compile_processes=processes):
        assert disk_cache.compile_cuda("src", "k", "k.cu") == (b"binary", "mangled")
    ((where, (first, job)),) = calls
    assert where == ("worker" if processes else "here")
    assert first == ("libnvrtc-test.so" if processes else "lib")
    assert (job.source, job.kernel, job.file_name, job.cubin) == ("src", "k", "k.cu", True)
    assert "--gpu-architecture=sm_90a" in job.options and "--include-path=/x" in job.options
    assert job.headers == {disk_cache._UTILS: b"standin"}
