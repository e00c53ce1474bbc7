"""``velox plan`` with every method installed: each default spec's shipped bytes against its
caches measured again at three KV shapes, eviction caps, the full ranking and recommendation,
and a spec that cannot run at a shape."""

import json
import os
from pathlib import Path

import pytest

from velox_cli import plan_bytes
from velox_cli.plan import Inputs, plan
from velox_cli.plan_table import render
from velox_cli.specs import default_specs

ROOT = Path(__file__).resolve().parents[1]
SHIPPED = json.loads(plan_bytes.DATA.read_text())["shapes"]
N_CHECK = 3584  # past the shipped points (2,560 and 3,072): the line extended, a fresh prompt


@pytest.mark.slow
@pytest.mark.skipif(
    os.environ.get("VELOX_PLAN_BYTES_CHECK") != "1",
    reason="every default spec's caches filled at three shapes: about 15 minutes on a CPU "
    "(nox -s plan runs it)",
)
@pytest.mark.parametrize("shape", ["llama3-8b", "qwen2.5-7b", "small"])  # 8x128, 4x128, 8x64
def test_shipped_bytes_are_the_caches_measured_again(shape):
    """Every default spec's shipped line at N_CHECK tokens within 2% of its caches built and
    filled afresh there: a changed codec or policy fails here until the data is measured
    again (``python -m velox_cli.plan_bytes --write``)."""
    specs = [s.text for s in default_specs()]
    runs = [s for s in specs if not SHIPPED[shape][s].get("error")]
    rows = plan_bytes.check(shape, specs, N_CHECK)
    assert len(rows) == len(runs) >= 50
    assert rows[0][3] <= 0.02, rows[:5]  # the worst first


def test_eviction_bytes_stop_at_the_budget():
    for shape, rows in SHIPPED.items():
        fp16 = plan_bytes.Curve("fp16", **rows["fp16"])
        for spec in ("snapkv:budget=1024", "streamingllm:budget=1024", "adakv:budget=1024"):
            c = plan_bytes.Curve(spec, **rows[spec])
            assert c.capped and c.per_token == 0, (shape, spec)
            assert c.at(1 << 20) == c.at(4096) < fp16.at(4096)
        share = plan_bytes.Curve("snapkv:budget=25%", **rows["snapkv:budget=25%"])
        assert not share.capped and share.at(1 << 17) > 30 * share.at(4096)


def test_the_default_plan_ranks_measured_settings_first():
    result = plan(Inputs("llama3-8b", None, 24 * 10**9, 128 * 1024))
    rows = [r for r in result["rows"] if not r["error"]]
    lows = [r["low"] for r in rows if r["accuracy"] is not None]
    assert lows == sorted(lows, reverse=True) and len(lows) >= 30
    first = next(i for i, r in enumerate(rows) if r["accuracy"] is None)
    assert all(r["accuracy"] is None for r in rows[first:])
    assert not next(r for r in rows if r["spec"] == "fp16")["fits"]  # 17 GB of cache at 128k
    best = min(
        (r for r in rows if r["fits"] and r["accuracy"] is not None),
        key=lambda r: (-r["low"], -r["accuracy"], r["kl"]),
    )
    assert result["recommendation"]["spec"] == best["spec"]
    errors = {r["spec"] for r in result["rows"] if r["error"]}
    fitted = {"palu:ratio=0.5", "commvq:key_bits=2,value_bits=4", "oscar:bits=2", "spectral"}
    assert fitted <= errors  # artifacts fitted on the model


def test_a_spec_that_cannot_run_at_the_shape_says_why():
    result = plan(Inputs("small", None, 10**9, 4096, methods=["fp16", "kitty"]))
    bad = [r for r in result["rows"] if r["error"]]
    assert [r["spec"] for r in bad] == ["kitty"] and "value head dim 64" in bad[0]["error"]
    assert "cannot run at this shape (1):" in render(result)
