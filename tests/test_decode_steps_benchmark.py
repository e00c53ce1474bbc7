"""benchmarks/decode_steps.py on the CPU: a small shape runs and its rows hold the intervals
and the steps that changed the stores (a correctness check of the script, not a
measurement)."""

import importlib.util
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_small_shape_rows(tmp_path):
    sys.path.insert(0, str(ROOT / "benchmarks"))
    spec = importlib.util.spec_from_file_location(
        "decode_steps", ROOT / "benchmarks" / "decode_steps.py"
    )
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    out = tmp_path / "steps.json"
    argv = ["--shape", "small", "--weights", "fp32", "--context", "300", "--chunk", "128"]
    argv += ["--caches", "fp16,uniform:bits=4", "--steps", "6", "--sync", "--sync-steps", "70"]
    assert mod.main([*argv, "--json", str(out)]) == 0
    rows = json.loads(out.read_text())
    assert [r["cache"] for r in rows] == ["fp16", "uniform:bits=4"]
    for r in rows:
        assert r["decode_tok_s"] > 0 and r["step_ms_median"] <= r["step_ms_max"]
        assert r["context"] == 300 and r["shape"] == "small"
    # fp16's KVCache has no coded tiers; uniform's window flushes every 64 tokens and grows
    # 16 at a time: some of the 70 steps change its stores, most do not
    assert rows[0]["sync_upkeep_steps"] == []
    upkeep = rows[1]["sync_upkeep_steps"]
    assert 1 <= len(upkeep) < 70 and all(u["upkeep"] for u in upkeep)
