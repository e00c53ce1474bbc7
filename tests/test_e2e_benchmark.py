"""benchmarks/e2e.py on the CPU: a small shape runs end to end and its rows hold what the
benchmark promises (a correctness check of the script, not a measurement)."""

import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _e2e():
    spec = importlib.util.spec_from_file_location("e2e", ROOT / "benchmarks" / "e2e.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


FIELDS = (
    "shape",
    "weights",
    "cache",
    "context",
    "batch",
    "prefill_s",
    "first_chunk_s",
    "first_step_s",
    "decode_tok_s",
    "host_ms_per_step",
    "sync_ms_per_step",
    "peak_bytes",
    "prefill_peak_bytes",
    "base_bytes",
    "cache_bytes",
)


@pytest.mark.parametrize("batch", ["1", "2"])
def test_small_shape_rows(tmp_path, batch):
    out = tmp_path / "e2e.json"
    argv = ["--shape", "small", "--weights", "fp32", "--contexts", "300", "--batch", batch]
    argv += ["--caches", "uniform:bits=4,fp16,mlx-q4", "--steps", "3", "--timed-steps", "2"]
    argv += ["--chunk", "128", "--json", str(out), "--no-warmup" if batch == "1" else "--chunk=96"]
    assert _e2e().main(argv) == 0
    data = json.loads(out.read_text())
    rows = data["rows"]
    assert [r["cache"] for r in rows] == ["fp16", "uniform:bits=4", "mlx-q4"]  # fp16 first
    for r in rows:
        assert "error" not in r, r.get("traceback")
        assert all(k in r for k in FIELDS), sorted(set(FIELDS) - set(r))
        assert r["batch"] == int(batch) and r["context"] == 300
        assert r["decode_tok_s"] > 0 and r["prefill_s"] > 0 and r["host_ms_per_step"] > 0
        assert r["peak_bytes"] >= r["prefill_peak_bytes"] >= r["base_bytes"] > 0
    fp16, velox = rows[0], rows[1]
    assert fp16["x_fp16_decode_tok_s"] == 1.0
    # 4-bit codes of float32 tokens: well under the float32 KVCache (its 256-token steps)
    assert velox["cache_bytes"] < 0.3 * fp16["cache_bytes"]
    assert velox["x_fp16_cache_bytes"] == velox["cache_bytes"] / fp16["cache_bytes"]


def test_bad_arguments_are_refused():
    e2e = _e2e()
    with pytest.raises(SystemExit):
        e2e.main(["--shape", "nope"])
    with pytest.raises(SystemExit):
        e2e.main(["--contexts", "12,x"])
    with pytest.raises(ValueError, match="weights"):
        e2e.build_model("small", "int3")
