"""benchmarks/serve_load.py on the CPU at tiny settings: velox serve and mlx-lm's server (fp16
and ``--kv-bits 4``) start, take the load and stop, and the JSON holds every row's fields (a
check of the script, not a measurement)."""

import json
from pathlib import Path

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


def flags(**options) -> list[str]:
    """serve_load's command line of ``options``: ``prompt_tokens=32`` is ``--prompt-tokens 32``."""
    return [a for name, v in options.items() for a in (f"--{name.replace('_', '-')}", str(v))]


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
    argv = flags(clients=2, requests=3, prompt_tokens=32, max_tokens=4, prompt_cache_bytes=BUDGET)
    assert serve_load.main([*argv, "--json", str(out)]) == 0
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
    argv = flags(baselines="", clients=4, requests=8, prompt_tokens=32, max_tokens=4, json=out)
    assert sl.main([*argv, "--malformed", str(2 * len(sl.MALFORMED))]) == 0
    row = json.loads(out.read_text())["rows"][0]
    assert row["server_alive"] and row["completed"] == 8 and row["errors"] == 0, row
    assert row["malformed_sent"] == 48 and row["malformed_leaks"] == 0, row["first_leak"]
    refused = [a for a in row["malformed_answers"] if a["status"] >= 400]
    assert len(refused) >= 44, row["malformed_answers"]  # a role-only chat message is served


@pytest.mark.skipif(find_shared("reference-model") is None, reason="needs the reference model")
def test_shape_model_is_written_once_and_loads_quantized(serve_load, tmp_path):
    """--shape's model directory: 4bit weights that mlx_lm.load loads quantized, the reference
    model's tokenizer, reused by a build of the same shape, weights and seed, and a directory
    holding anything else refused."""
    import mlx.nn as nn
    from mlx_lm import load
    from mlx_lm.utils import load_tokenizer

    ref = find_shared("reference-model")
    out = tmp_path / "models" / "small"
    assert serve_load.build_shape_model("small", "4bit", 0, out, ref) is True
    config = json.loads((out / "config.json").read_text())
    assert config["quantization"] == {"group_size": 64, "bits": 4, "mode": "affine"}
    assert config["vocab_size"] == 2048 and config["num_hidden_layers"] == 4
    weights = out / "model.safetensors"
    stamp = weights.stat().st_mtime_ns
    assert serve_load.build_shape_model("small", "4bit", 0, out, ref) is False
    assert weights.stat().st_mtime_ns == stamp  # reused, not rebuilt
    assert sorted(p.name for p in out.parent.iterdir()) == ["small"]  # no partial build left
    model, tokenizer = load(str(out))
    assert isinstance(model.layers[0].self_attn.q_proj, nn.QuantizedLinear)
    text = "def main(argv):\n    return 0"
    assert tokenizer.encode(text) == load_tokenizer(ref).encode(text)
    with pytest.raises(ValueError, match="built otherwise"):
        serve_load.build_shape_model("small", "4bit", 1, out, ref)
    other = tmp_path / "other"
    other.mkdir()
    (other / "notes.txt").write_text("mine")
    with pytest.raises(ValueError, match="files of another kind"):
        serve_load.build_shape_model("small", "fp32", 0, other, ref)
    assert sorted(p.name for p in other.iterdir()) == ["notes.txt"]


@pytest.mark.skipif(find_shared("reference-model") is None, reason="needs the reference model")
def test_prompts_stay_below_a_shape_vocabulary_smaller_than_the_tokenizer(serve_load):
    """The reference tokenizer has 8,192 tokens, the small shape 2,048: its prompts are made of
    words below 2,048 and still hold --prompt-tokens tokens; where the model's vocabulary holds
    the tokenizer's, the prompts are the ones made without a vocabulary."""
    import argparse

    from mlx_lm.utils import load_tokenizer

    tok = load_tokenizer(find_shared("reference-model"))
    a = argparse.Namespace(seed=0, requests=6, prompt_tokens=64, prefix_tokens=None, shared=0.5)
    prompts, shared = serve_load.make_prompts(tok, a, 2048)
    assert len(set(prompts)) == 6 and sum(shared) == 3
    for p in prompts:
        ids = tok.encode(p)
        assert max(ids) < 2048 and abs(len(ids) - 64) <= 1, (len(ids), max(ids))
    assert max(tok.encode(serve_load.warmup_prompt(tok, 2048))) < 2048
    assert serve_load.make_prompts(tok, a, 128256) == serve_load.make_prompts(tok, a)
    assert serve_load.warmup_prompt(tok) == "Warm up."
    with pytest.raises(ValueError, match="too few"):
        serve_load.make_prompts(tok, a, 300)


@pytest.mark.skipif(find_shared("reference-model") is None, reason="needs the reference model")
def test_shape_arguments_are_checked(serve_load, capsys):
    with pytest.raises(SystemExit):
        serve_load.main(["--shape", "small", "--model", "x"])
    assert "not allowed with" in capsys.readouterr().err
    with pytest.raises(SystemExit, match="go with --shape"):
        serve_load.main(["--weights", "fp32"])
    with pytest.raises(SystemExit, match="past the shape's vocab_size 2048"):
        serve_load.main(["--shape", "small", "--malformed", "2"])


@pytest.mark.slow
@pytest.mark.skipif(find_shared("reference-model") is None, reason="needs the reference model")
def test_tiny_load_on_a_shape_model(serve_load, tmp_path):
    """--shape small --weights fp32: velox serve and mlx-lm's fp16 server serve the written
    model; a second run reuses its --model-dir; without --model-dir it is removed at exit."""
    out, model_dir = tmp_path / "serve_load.json", tmp_path / "small"
    shape = flags(shape="small", weights="fp32", json=out)
    argv = [*shape, *flags(baselines="fp16", clients=2, requests=3, prompt_tokens=32, max_tokens=4)]
    assert serve_load.main([*argv, "--model-dir", str(model_dir)]) == 0
    data = json.loads(out.read_text())
    assert data["settings"]["shape"] == "small" and data["settings"]["weights"] == "fp32"
    assert data["settings"]["model"] == str(model_dir.resolve())
    assert data["shape_model"]["built"] is True
    rows = {r["server"]: r for r in data["rows"]}
    assert list(rows) == ["velox uniform:bits=4", "mlx_lm fp16"]
    for row in rows.values():
        assert row["completed"] == 3 and row["errors"] == 0, row
        assert row["generated_tokens"] == 3 * 4, row
        assert abs(row["prompt_tokens_mean"] - 32) <= 1, row
    assert (model_dir / serve_load.SHAPE_MARKER).is_file()

    short = [*shape, *flags(baselines="", clients=1, requests=1, prompt_tokens=16, max_tokens=2)]
    assert serve_load.main([*short, "--model-dir", str(model_dir)]) == 0
    assert json.loads(out.read_text())["shape_model"]["built"] is False
    assert serve_load.main(short) == 0
    data = json.loads(out.read_text())
    assert data["shape_model"]["built"] is True and data["rows"][0]["completed"] == 1
    assert not Path(data["settings"]["model"]).exists()
