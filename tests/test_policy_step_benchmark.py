"""benchmarks/policy_step.py on the CPU: a small context runs for three policies (one a spec
with settings) and its rows and JSON hold what the benchmark promises (a check of the
script, not a measurement)."""

import json


def test_rows_and_json(load_benchmark, tmp_path, capsys):
    bench = load_benchmark("policy_step")
    out = tmp_path / "rows.json"
    rows = bench.main(
        [
            "--methods", "streamingllm", "h2o", "morphkv:keep_weights=false",
            "--context", "256", "--budget", "64", "--chunk", "128",
            "--steps", "2", "--repeats", "1", "--json", str(out),
        ]
    )  # fmt: skip
    assert [r["method"] for r in rows] == ["streamingllm", "h2o", "morphkv:keep_weights=false"]
    assert rows[0]["x_first"] == 1.0 and all(r["step_ms"] > 0 for r in rows)
    assert json.loads(out.read_text())["rows"] == rows
    assert "ms/step" in capsys.readouterr().out
