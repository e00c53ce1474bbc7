"""The velox command: subcommands, JSON rows, and one-line errors with exit code 2."""

import json
import re

import pytest
from refused import assert_refused

from velox_cli.main import main
from velox_core import make_cache, save_cache
from velox_testing import kv_data, tiny_model

FIELDS = {
    "spec",
    "method",
    "params",
    "context",
    "cache_bytes",
    "bytes_per_token",
    "compression_ratio",
    "kl",
    "top1",
    "ppl",
    "retrieval",
    "prefill_tps",
    "decode_tps",
    "peak_memory",
}


def test_bench_quick_writes_rows_table_and_chart(
    model_dir, text_file, tmp_path, capsys, monkeypatch
):
    monkeypatch.setenv("COLUMNS", "120")
    out = tmp_path / "rows.json"
    chart = tmp_path / "chart.png"
    md = tmp_path / "table.md"
    argv = ["bench", "--model", model_dir, "--data", text_file, "--quick", "--context", "256"]
    argv += ["--methods", "fp16", "mlx-q8", "uniform:bits=4"]
    assert main([*argv, "--json", str(out), "--chart", str(chart), "--markdown", str(md)]) == 0
    rows = json.loads(out.read_text())
    assert isinstance(rows, list) and rows[0]["run"]["context"] == 256
    assert [r["spec"] for r in rows] == ["fp16", "mlx-q8", "uniform:bits=4"]
    for r in rows:
        assert set(r) >= FIELDS and r["error"] is None
        assert r["cache_bytes"] > 0 and r["peak_memory"] > 0
    assert rows[0]["kl"] == pytest.approx(0, abs=1e-6) and rows[0]["compression_ratio"] == 1.0
    assert rows[2]["compression_ratio"] > 2.5
    assert chart.read_bytes()[:4] == b"\x89PNG"
    assert "uniform:bits=4" in md.read_text()
    printed = capsys.readouterr().out
    assert "uniform:bits=4" in printed
    # the table at the terminal's width (COLUMNS), Pareto rows marked, the best near 4x
    lines = printed.splitlines()
    assert max(map(len, lines)) <= 120
    assert any(line.lstrip().startswith("*") for line in lines)
    assert any(line.startswith("best setting on ") for line in lines)
    assert {x[:11] for x in lines} >= {"  about 4x:", "  about 8x:"}


def test_bench_in_worker_processes_gives_the_rows_of_one_process(model_dir, text_file, tmp_path):
    """--jobs 2 measures the specs in two worker processes: every quality, recall and byte
    figure equals a one-process run's (speeds and peak memory are measurements, not compared),
    rows keep the order of --methods, and the run records its jobs."""
    specs = ["fp16", "mlx-q8", "uniform:bits=2", "uniform:bits=4,group=32"]
    got = {}
    for jobs in (1, 2):
        out = tmp_path / f"rows{jobs}.json"
        argv = ["bench", "--model", model_dir, "--data", text_file, "--context", "256"]
        argv += ["--samples", "2", "--continuation", "8", "--methods", *specs]
        assert main([*argv, "--jobs", str(jobs), "--json", str(out), "--chart", ""]) == 0
        got[jobs] = json.loads(out.read_text())
    for jobs, rows in got.items():
        assert [r["spec"] for r in rows] == specs
        assert all(r["error"] is None and r["peak_memory"] > 0 for r in rows)
        assert rows[0]["run"]["jobs"] == jobs
    keys = ("kl", "top1", "ppl", "retrieval", "cache_bytes", "tokens", "compression_ratio")
    for a, b in zip(got[1], got[2]):
        assert {k: a[k] for k in keys} == {k: b[k] for k in keys}, a["spec"]
    assert got[1][2]["kl"] > 0  # the compared figures are not trivially equal


@pytest.mark.parametrize(
    "argv,needle",
    [
        (["bench", "--methods", "nope"], "unknown method 'nope'"),
        (["bench", "--methods", "uniform:bitz=3"], "no parameter 'bitz'"),
        (["bench", "--methods", "uniform:bits=11"], "bits"),
        (["bench", "--model", "/no/such/model"], "no such path"),
        (["bench", "--context", "0"], "--context"),
        (["generate", "--method", "nope:x=1"], "unknown method"),
        (["inspect", "/no/such/file.safetensors"], "no such file"),
        (["generate", "--temp", "-1"], "--temp"),
        (["fit", "nosuch", "--model", "x"], "no fitter for 'nosuch'"),
        (["bench", "--frobnicate"], "unrecognized arguments"),
        (["bench", "--jobs", "-1"], "--jobs"),
    ],
)
def test_bad_input_is_one_line_and_exit_code_2(argv, needle, capsys):
    assert_refused(argv, needle, capsys)


def test_methods_json_lists_parameters(capsys):
    assert main(["methods", "--json"]) == 0
    ms = {m["name"]: m for m in json.loads(capsys.readouterr().out)}
    assert ms["uniform"]["parameters"]["bits"] == 4
    assert {"bits": 4} in ms["uniform"]["recommended"]
    assert main(["methods"]) == 0 and "uniform" in capsys.readouterr().out


def test_inspect_a_saved_cache(model_dir, tmp_path, capsys):
    k, v = kv_data(t=50)
    c = make_cache(tiny_model("llama"), "uniform:bits=4")[0]
    c.update_and_fetch(k, v)
    path = tmp_path / "c.safetensors"
    save_cache(path, [c])
    assert main(["inspect", str(path)]) == 0
    out = capsys.readouterr().out
    assert "uniform" in out and "50" in out
    raw = bytearray(path.read_bytes())
    raw[raw.index(b"offset")] = ord("O")  # one byte of the header
    path.write_bytes(bytes(raw))
    assert main(["inspect", str(path)]) == 2
    assert "checksum" in capsys.readouterr().err


def test_generate_prints_text_and_measured_memory(model_dir, capsys):
    assert (
        main(
            [
                "generate",
                "--model",
                model_dir,
                "--method",
                "uniform:bits=4,flush=1",
                "--prompt",
                "def add(a, b):",
                "--max-tokens",
                "8",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "[velox] uniform:bits=4,flush=1" in out and "MiB resident" in out and "fp16 cache" in out
    assert "wait in fp16" not in out  # flush=1, window=0: every token is coded
    # the ratio compares the stored tokens' bytes (every token coded at once by flush=1: 4-bit
    # codes and group-64 scales, about 3.6x), not fp16's 256-token allocation
    ratio = float(re.search(r"\((\d+\.\d+)x; held bytes", out).group(1))
    assert 3.0 < ratio < 4.5, out


def test_fit_dispatches_to_the_methods_entry_point(monkeypatch):
    """velox fit NAME ARGS calls the fitter a method package registers in `velox.fit` with
    the rest of the command line, and returns its exit code."""
    import importlib.metadata

    calls = []

    class Fitter:
        name = "demo"

        def load(self):
            return lambda argv: calls.append(argv) or 3

    real = importlib.metadata.entry_points
    monkeypatch.setattr(
        importlib.metadata,
        "entry_points",
        lambda group=None, **kw: [Fitter()] if group == "velox.fit" else real(group=group, **kw),
    )
    assert main(["fit", "demo", "--model", "m", "--tokens", "64"]) == 3
    assert calls == [["--model", "m", "--tokens", "64"]]


def test_split_specs_keeps_each_specs_own_parameters():
    from velox_cli.specs import split_specs

    text = "fp16, kivi:bits=2,group=32,window=128,qjl,snapkv:kernel=15,budget=25%+uniform:bits=8,"
    assert split_specs(text) == [
        "fp16",
        "kivi:bits=2,group=32,window=128",
        "qjl",
        "snapkv:kernel=15,budget=25%+uniform:bits=8",
    ]
    for bad in ("bits=4", "fp16,bits=4"):
        with pytest.raises(ValueError, match="follows no spec with parameters"):
            split_specs(bad)
