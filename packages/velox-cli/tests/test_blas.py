"""The fast BLAS that ``velox bench`` preloads where MLX bundles a reference BLAS."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from velox_cli import blas

pytestmark = pytest.mark.skipif(
    sys.platform != "linux" or blas.mlx_reference_blas() is None,
    reason="MLX bundles its reference BLAS only in the Linux CPU wheel",
)

CLEAN = ("LD_PRELOAD", "VELOX_BLAS", "VELOX_NO_OPENBLAS", "OPENBLAS_NUM_THREADS", blas.ACTIVE)


def _fast():
    lib, what, reasons = blas.find_blas()
    if lib is None:
        pytest.skip(f"no fast BLAS installed here: {reasons}")
    return lib, what


def _env(**extra):
    env = {k: v for k, v in os.environ.items() if k not in CLEAN}
    env.update(extra)
    return env


class _Exec(Exception):
    pass


@pytest.fixture
def execve(monkeypatch):
    """Captures os.execve's arguments instead of replacing the test process."""
    calls = []

    def fake(path, argv, env):
        calls.append((path, argv, env))
        raise _Exec

    monkeypatch.setattr(os, "execve", fake)
    for k in CLEAN:
        monkeypatch.delenv(k, raising=False)
    return calls


def test_preload_reexecutes_once_with_the_library_and_says_so(execve, capsys):
    lib, what = _fast()
    with pytest.raises(_Exec):
        blas.preload(["bench", "--quick"])
    (path, argv, env) = execve[0]
    assert path == sys.executable and argv == [
        sys.executable,
        "-m",
        "velox_cli",
        "bench",
        "--quick",
    ]
    assert env["LD_PRELOAD"] == str(lib) and env[blas.ACTIVE] == str(lib)
    assert env["OPENBLAS_NUM_THREADS"] == "1"
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and what in err and "VELOX_BLAS=off" in err


def test_preload_keeps_an_existing_preload_after_its_own(execve, monkeypatch):
    lib, _ = _fast()
    monkeypatch.setenv("LD_PRELOAD", "/some/libjemalloc.so")
    monkeypatch.setenv("OPENBLAS_NUM_THREADS", "2")
    with pytest.raises(_Exec):
        blas.preload(["bench"])
    assert execve[0][2]["LD_PRELOAD"] == f"{lib}:/some/libjemalloc.so"
    assert execve[0][2]["OPENBLAS_NUM_THREADS"] == "2"  # the user's choice is kept


@pytest.mark.parametrize(
    "var,value",
    [
        ("VELOX_BLAS", "off"),
        ("VELOX_NO_OPENBLAS", "1"),
        (blas.ACTIVE, "/already/preloaded.so"),
        ("LD_PRELOAD", "/usr/lib/x86_64-linux-gnu/libopenblas.so.0"),
    ],
)
def test_preload_does_nothing_when_opted_out_or_already_done(
    execve, monkeypatch, capsys, var, value
):
    monkeypatch.setenv(var, value)
    blas.preload(["bench"])
    assert execve == [] and capsys.readouterr().err == ""


def test_a_missing_velox_blas_is_one_line_and_no_reexecution(execve, monkeypatch, capsys):
    monkeypatch.setenv("VELOX_BLAS", "/no/such/libblas.so")
    blas.preload(["bench"])
    err = capsys.readouterr().err.strip()
    assert execve == [] and len(err.splitlines()) == 1
    assert "/no/such/libblas.so" in err and "reference BLAS" in err


def test_the_preloaded_blas_serves_mlx_and_computes_correctly(tmp_path):
    lib, _ = _fast()
    code = (
        "import numpy as np, mlx.core as mx\n"
        "from velox_cli.blas import active_blas\n"
        "r = np.random.default_rng(0)\n"
        "a = r.standard_normal((300, 200), dtype=np.float32)\n"
        "b = r.standard_normal((200, 500), dtype=np.float32)\n"
        "np.save('out.npy', np.array(mx.array(a) @ mx.array(b)))\n"
        "print(active_blas())\n"
    )
    for preload, expect in ((str(lib), "OpenBLAS"), (None, "reference BLAS")):
        env = _env(**({"LD_PRELOAD": preload} if preload else {}))
        out = subprocess.run(
            [sys.executable, "-c", code], env=env, cwd=tmp_path, capture_output=True, text=True
        )
        assert out.returncode == 0, out.stderr
        assert expect in out.stdout
        r = np.random.default_rng(0)
        a = r.standard_normal((300, 200), dtype=np.float32)
        b = r.standard_normal((200, 500), dtype=np.float32)
        np.testing.assert_allclose(np.load(tmp_path / "out.npy"), a @ b, rtol=1e-4, atol=1e-3)


def test_velox_bench_preloads_it_and_records_it(model_dir, text_file, tmp_path):
    _fast()
    rows = tmp_path / "rows.json"
    argv = ["bench", "--model", model_dir, "--data", text_file, "--quick", "--context", "128"]
    argv += ["--methods", "fp16", "--json", str(rows), "--chart", ""]
    out = subprocess.run(
        [sys.executable, "-m", "velox_cli", *argv], env=_env(), capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr
    assert out.stderr.startswith("velox: preloading ")
    assert json.loads(rows.read_text())[0]["run"]["blas"].startswith("OpenBLAS")
    off = subprocess.run(
        [sys.executable, "-m", "velox_cli", *argv], env=_env(VELOX_BLAS="off"), capture_output=True
    )
    assert off.returncode == 0 and b"preloading" not in off.stderr
    assert "reference BLAS" in json.loads(rows.read_text())[0]["run"]["blas"]
