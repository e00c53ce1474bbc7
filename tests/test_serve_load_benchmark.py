"""benchmarks/serve_load.py on the CPU at tiny settings: velox serve and mlx-lm's server (fp16
and ``--kv-bits 4``) start, take the load and stop, and the JSON holds every row's fields (a
check of the script, not a measurement)."""

import json

import pytest

from velox_cli.data import find_shared

BUDGET = 2_000_000

ROW_FIELDS = (
    "server",
    "command",
    "requests",
    "completed",
    "errors",
    "wall_s",
    "generated_tokens",
    "decode_tok_s",
    "request_decode_tok_s_median",
    "ttft_s_median",
    "ttft_s_p90",
    "prompt_tokens_mean",
    "cached_tokens",
    "mlx_peak_bytes",
    "rss_peak_bytes",
    "cache_bytes_max",
    "cache_budget_bytes",
    "polls",
    "polls_over_budget",
    "sessions_held_max",
    "cache_entries_max",
    "streams_concurrent_max",
)


@pytest.fixture(scope="module")
def serve_load(load_benchmark):
    return load_benchmark("serve_load")


def test_sessions_are_entries_no_other_extends(serve_load):
    sessions = serve_load.sessions
    assert sessions([]) == 0
    assert sessions([[1, 2], [1, 2, 3], [1, 4]]) == 2
    assert sessions([[5], [1, 2, 0], [1, 2], [1, 2, 3]]) == 3


@pytest.mark.slow
@pytest.mark.skipif(find_shared("reference-model") is None, reason="needs the reference model")
def test_tiny_load_on_every_server(serve_load, tmp_path, capsys):
    out = tmp_path / "serve_load.json"
    argv = [
        "--clients", "2",
        "--requests", "3",
        "--prompt-tokens", "32",
        "--max-tokens", "4",
        "--prompt-cache-bytes", str(BUDGET),
        "--json", str(out),
    ]  # fmt: skip
    assert serve_load.main(argv) == 0
    data = json.loads(out.read_text())
    assert data["settings"]["requests"] == 3 and data["settings"]["max_tokens"] == 4
    assert data["machine"]["mlx"] and data["machine"]["blas"]
    rows = {r["server"]: r for r in data["rows"]}
    assert list(rows) == ["velox uniform:bits=4", "mlx_lm fp16", "mlx_lm kv4"]
    for name, row in rows.items():
        missing = [f for f in ROW_FIELDS if f not in row]
        assert not missing, (name, missing)
        assert row["completed"] == 3 and row["errors"] == 0, row
        assert row["generated_tokens"] == 3 * 4, row  # no answer stops early
        assert row["decode_tok_s"] > 0 and row["mlx_peak_bytes"] > 0, row
        assert 0 < row["ttft_s_median"] <= row["ttft_s_p90"], row
        assert row["cache_budget_bytes"] == BUDGET and row["polls"] >= 1, row
        assert row["sessions_held_max"] >= 1, row
    assert "--kv-bits 4" in rows["mlx_lm kv4"]["command"]
    velox = rows["velox uniform:bits=4"]
    assert velox["polls_over_budget"] == 0 and velox["cache_bytes_max"] <= BUDGET, velox
    assert velox["cache_peak_bytes"] <= BUDGET, velox
    assert rows["mlx_lm kv4"]["streams_concurrent_max"] == 1  # served one at a time
    printed = capsys.readouterr().out
    assert all(name in printed for name in rows) and "TTFT med s" in printed


@pytest.mark.skipif(find_shared("reference-model") is None, reason="needs the reference model")
def test_hostile_requests_among_the_load_leave_velox_serve_serving(serve_load, tmp_path):
    """48 hostile requests (each kind of serve_load.MALFORMED twice) among 8 well-formed ones,
    4 clients at once: no server death, every well-formed request answered, no traceback or
    path of this machine in any answer (a logit_bias token past the vocabulary crashed the
    process, a request naming another model unloaded the served one mid-batch)."""
    sl = serve_load
    out = tmp_path / "serve_load.json"
    argv = [
        "--baselines", "",
        "--clients", "4",
        "--requests", "8",
        "--prompt-tokens", "32",
        "--max-tokens", "4",
        "--malformed", str(2 * len(sl.MALFORMED)),
        "--json", str(out),
    ]  # fmt: skip
    assert sl.main(argv) == 0
    row = json.loads(out.read_text())["rows"][0]
    assert row["server_alive"] and row["completed"] == 8 and row["errors"] == 0, row
    assert row["malformed_sent"] == 48 and row["malformed_leaks"] == 0, row["first_leak"]
    refused = [a for a in row["malformed_answers"] if a["status"] >= 400]
    assert len(refused) >= 44, row["malformed_answers"]  # a role-only chat message is served
