"""benchmarks/e2e.py on the CPU: a small shape runs end to end and its rows hold what the
benchmark promises (a correctness check of the script, not a measurement)."""

import json

import pytest


@pytest.fixture(scope="module")
def e2e(load_benchmark):
    return load_benchmark("e2e")


# what every row holds besides the timed fields (the benchmark's MEDIAN_FIELDS)
ROW_FIELDS = (
    "shape",
    "weights",
    "cache",
    "context",
    "batch",
    "first_step_s",
    "peak_bytes",
    "prefill_peak_bytes",
    "base_bytes",
    "cache_bytes",
    "step_ms",
    "slow_steps",
)


@pytest.mark.parametrize("batch", ["1", "2"])
def test_small_shape_rows(e2e, tmp_path, batch):
    out = tmp_path / "e2e.json"
    argv = ["--shape", "small", "--weights", "fp32", "--contexts", "300", "--batch", batch]
    argv += ["--caches", "uniform:bits=4,fp16,mlx-q4", "--steps", "3", "--timed-steps", "2"]
    argv += ["--chunk", "128", "--json", str(out), "--no-warmup" if batch == "1" else "--chunk=96"]
    assert e2e.main(argv) == 0
    data = json.loads(out.read_text())
    rows = data["rows"]
    assert [r["cache"] for r in rows] == ["fp16", "uniform:bits=4", "mlx-q4"]  # fp16 first
    fields = (*ROW_FIELDS, *e2e.MEDIAN_FIELDS)
    for r in rows:
        assert "error" not in r, r.get("traceback")
        assert all(k in r for k in fields), sorted(set(fields) - set(r))
        assert r["batch"] == int(batch) and r["context"] == 300
        assert r["decode_tok_s"] > 0 and r["prefill_s"] > 0 and r["host_ms_per_step"] > 0
        assert r["peak_bytes"] >= r["prefill_peak_bytes"] >= r["base_bytes"] > 0
        med, p90, top = r["step_ms"]
        assert 0 < med <= p90 <= top
        assert all(ms > 2 * med for _, ms in r["slow_steps"])
    fp16, velox = rows[0], rows[1]
    assert fp16["x_fp16_decode_tok_s"] == 1.0
    # 4-bit codes of float32 tokens: well under the float32 KVCache (its 256-token steps)
    assert velox["cache_bytes"] < 0.3 * fp16["cache_bytes"]
    assert velox["x_fp16_cache_bytes"] == velox["cache_bytes"] / fp16["cache_bytes"]


def test_repeats_rotate_the_caches_and_keep_medians(e2e, tmp_path, capsys):
    out = tmp_path / "e2e.json"
    argv = ["--shape", "small", "--weights", "fp32", "--contexts", "200", "--repeats", "3"]
    argv += ["--caches", "fp16,uniform:bits=4", "--steps", "2", "--timed-steps", "2"]
    argv += ["--chunk", "128", "--json", str(out), "--no-warmup"]
    assert e2e.main(argv) == 0
    runs = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line[:1] == "{"]
    assert [r["cache"] for r in runs] == ["fp16", "uniform:bits=4"] * 3  # in rotation
    rows = json.loads(out.read_text())["rows"]
    assert [r["cache"] for r in rows] == ["fp16", "uniform:bits=4"]
    for row in rows:
        mine = [r for r in runs if r["cache"] == row["cache"]]
        assert row["decode_tok_s_runs"] == [r["decode_tok_s"] for r in mine]
        assert row["decode_tok_s"] == sorted(row["decode_tok_s_runs"])[1]
        assert row["peak_bytes"] == max(r["peak_bytes"] for r in mine)


def test_bad_arguments_are_refused(e2e):
    with pytest.raises(SystemExit):
        e2e.main(["--shape", "nope"])
    with pytest.raises(SystemExit):
        e2e.main(["--contexts", "12,x"])
    with pytest.raises(SystemExit, match="repeats"):
        e2e.main(["--shape", "small", "--weights", "fp32", "--repeats", "0"])
    with pytest.raises(ValueError, match="weights"):
        e2e.build_model("small", "int3")


def test_latent_attention_shape_rows(e2e, tmp_path):
    """The MLA shape (mlx-lm's deepseek_v3) runs through the same loop: velox's latent cache
    on every layer, its bytes below the model's own fp16 latent cache, its decode steps read
    from the latent's codes."""
    out = tmp_path / "e2e.json"
    argv = ["--shape", "mla-small", "--weights", "fp32", "--contexts", "256"]
    argv += ["--caches", "fp16,uniform:bits=4", "--steps", "3", "--timed-steps", "2"]
    argv += ["--chunk", "128", "--json", str(out), "--no-warmup"]
    assert e2e.main(argv) == 0
    rows = {r["cache"]: r for r in json.loads(out.read_text())["rows"]}
    assert all("error" not in r for r in rows.values()), rows
    # 256 + 3 tokens: mlx-lm's cache holds 512 slots (it grows 256 at a time) of the
    # latent's 128 and the RoPE key's 32 fp16 channels, in each of the 2 layers
    assert rows["fp16"]["cache_bytes"] == 2 * 512 * (128 + 32) * 2
    assert rows["uniform:bits=4"]["cache_bytes"] < 0.3 * rows["fp16"]["cache_bytes"]
    assert rows["uniform:bits=4"]["latent_decode"] == "codes"  # decode read the codes
    assert "latent_decode" not in rows["fp16"]
