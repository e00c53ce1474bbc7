"""The GPU checks' case tables (``tests/test_gpu_attention.py``) and the GPU benchmark's
command line (``benchmarks/gpu_attention.py``), checked without a GPU: every case builds its
codecs and caches, binds to its check and names real kernel settings; every check has a
test; the script mode reports each check; every command the docs give the benchmark parses.
"""

from __future__ import annotations

import importlib.util
import inspect
import json
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from velox_core.kernels.config import KernelConfig

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def checks_module():
    name = "gpu_attention_checks"  # a copy of its own, beside the one pytest collects
    spec = importlib.util.spec_from_file_location(name, ROOT / "tests" / "test_gpu_attention.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod  # dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def bench(load_benchmark):
    return load_benchmark("gpu_attention")


@pytest.mark.parametrize("quick", [False, True])
def test_every_case_builds_and_binds_on_the_cpu(checks_module, quick):
    cases = checks_module.checks(quick)
    names = [c.name for c in cases]
    assert len(names) == len(set(names)), "two checks share a name (a test id)"
    for case in cases:
        inspect.signature(case.check).bind(**case.kwargs)  # no unknown or missing argument
        KernelConfig().replace(**case.settings)  # settings are KernelConfig fields and values
        for key in ("keys", "values"):
            if key in case.kwargs:  # decode checks: codec makers
                assert hasattr(case.kwargs[key](), "kernel_keys"), (case.name, key)
        if case.check is checks_module.cache_check:
            assert hasattr(case.kwargs["make"](), "update_and_fetch"), case.name
        elif "make" in case.kwargs:  # encode checks: codec makers
            assert hasattr(case.kwargs["make"](), "encode"), case.name


def test_quick_tables_cut_only_the_long_contexts(checks_module):
    full, quick = checks_module.checks(), checks_module.checks(True)
    assert [c.check for c in full] == [c.check for c in quick]
    assert max(c.kwargs.get("t", 0) for c in full) == 40_961
    for f, q in zip(full, quick):
        tf, tq = f.kwargs.get("t", 0), q.kwargs.get("t", 0)
        assert tq <= (tf if tf <= 5000 else 2000), (f.name, tf, tq)
        assert re.sub(r"T\d+", "T", f.name) == re.sub(r"T\d+", "T", q.name)
        same = {k: v for k, v in f.kwargs.items() if k not in ("t", "keys", "values", "make")}
        assert same == {k: v for k, v in q.kwargs.items() if k in same}, f.name
        assert f.settings == q.settings, f.name


def test_every_check_runs_in_a_test(checks_module):
    """The tests' parameters are the table's cases, each once: no check is left out."""
    ids = []
    for name, fn in vars(checks_module).items():
        if name.startswith("test_"):
            for mark in getattr(fn, "pytestmark", []):
                if mark.name == "parametrize":
                    ids += [p.id for p in mark.args[1]]
    assert sorted(ids) == sorted(c.name for c in checks_module.CHECKS)


def test_run_check_refuses_where_the_kernels_are_off(checks_module):
    """On the CPU the kernels are off: both arms would run the reference, so the check fails
    without running."""

    def never(**_):
        raise AssertionError("the check ran")

    ok, errs = checks_module.run_check(checks_module.Case("x", never))
    assert not ok and "kernels not active" in errs["error"]


def test_script_mode_reports_every_check(checks_module, monkeypatch, tmp_path, capsys):
    def passes():
        return True, {"out_rel": 1.25e-4, "kernel": "portable"}

    def fails():
        return False, {"out_rel": 0.5}

    def raises():
        raise RuntimeError("boom")

    cases = [checks_module.Case(f.__name__, f) for f in (passes, fails, raises)]
    cases.append(checks_module.Case("cuda only", passes, cuda_only=True))
    monkeypatch.setattr(checks_module, "checks", lambda quick: cases)
    monkeypatch.setattr(checks_module, "use_kernels", lambda: True)
    monkeypatch.setattr(checks_module, "backend", lambda: "metal")
    out = tmp_path / "checks.json"
    assert checks_module.main(["--json", str(out)]) == 1
    text = capsys.readouterr().out
    assert "PASS  passes" in text and "out_rel=0.000125 kernel=portable" in text
    assert "FAIL  fails" in text and "FAIL  raises" in text and "RuntimeError: boom" in text
    assert "1/3 passed" in text and "cuda only" not in text
    rows = json.loads(out.read_text())["checks"]
    assert [(r["name"], r["status"]) for r in rows] == [
        ("passes", "PASS"),
        ("fails", "FAIL"),
        ("raises", "FAIL"),
    ]
    assert "traceback" in rows[2]


def _documented_commands() -> list[list[str]]:
    """The arguments of every command docs/performance.md and README.md give
    benchmarks/gpu_attention.py (code spans and fenced blocks, joined across line breaks)."""
    found = []
    for doc in ("docs/performance.md", "README.md"):
        text = (ROOT / doc).read_text()
        blocks = re.findall(r"```\w*\n(.*?)```", text, flags=re.S)
        text = re.sub(r"```\w*\n.*?```", "", text, flags=re.S)
        for span in blocks + re.findall(r"`([^`]+)`", text):
            if "benchmarks/gpu_attention.py" not in span:
                continue
            words = shlex.split(span.replace("\n", " "))
            for i, w in enumerate(words):
                if w.endswith("benchmarks/gpu_attention.py"):
                    args = []
                    for a in words[i + 1 :]:
                        if a in ("&&", "||", ";", "|"):
                            break
                        args.append(a)
                    found.append(args)
    return found


def test_documented_commands_parse(bench):
    commands = _documented_commands()
    assert sum(1 for c in commands if "--skip" in c) >= 2  # the device-time runs
    for args in commands:
        bench.parse_options(args)  # a usage error exits


def test_options_are_checked(bench, capsys):
    got = bench.parse_options(["--skip", "e2e, tuning", "--shapes", "1x131072,8X4096"])
    assert got.skip == {"e2e", "tuning"} and got.shapes == [(1, 131072), (8, 4096)]
    assert bench.parse_options(["--batches", "1,8"]).batches == (1, 8)
    for argv, message in (
        (["--skip", "checks"], "tests/test_gpu_attention.py"),
        (["--skip", "e2e,nope"], "unknown sections ['nope']"),
        (["--shapes", "1x2x3"], "--shapes takes BxT"),
        (["--shapes", "0x4096"], "--shapes takes BxT"),
        (["--contexts", "4k"], "--contexts takes positive integers"),
        (["--batches", "0"], "--batches takes positive integers"),
    ):
        with pytest.raises(SystemExit):
            bench.parse_options(argv)
        assert message in capsys.readouterr().err, argv


def test_help_lists_the_sections():
    res = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "gpu_attention.py"), "--help"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert res.returncode == 0, res.stderr
    assert "bandwidth,attention,tuning,device,encode,e2e" in res.stdout
