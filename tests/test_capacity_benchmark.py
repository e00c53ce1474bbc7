"""benchmarks/capacity.py: the search on synthetic peaks, the targets from rows, and a real
``--tiny`` run on the CPU (fp16 and uniform 4-bit in two MiB budgets; a check of the script,
not a measurement)."""

import argparse
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MiB = 2**20


@pytest.fixture(scope="module")
def cap(load_benchmark):
    return load_benchmark("capacity")


# ---------------------------------------------------------------- the search, synthetic peaks

WEIGHTS = 1000


def _fake_probe(cap, per_token, step=1, calls=None):
    """A probe whose peak is the weights plus ``per_token`` bytes per stored token, stored in
    allocations of ``step`` tokens, stopping where a real probe stops (prefill chunks, then
    each decoded token)."""

    def peak_of(tokens):
        return WEIGHTS + per_token * step * math.ceil(tokens / step)

    def probe(model, spec, context, budget, args):
        if calls is not None:
            calls.append(context)
        done = 0
        while context - done > 1:
            done += min(args.chunk, context - done - 1)
            if peak_of(done) > budget:
                return cap.Probe(context, peak_of(done), False, WEIGHTS, 0.0, "prefill", done)
        for k in range(1, args.decode + 1):
            if peak_of(done + k) > budget:
                return cap.Probe(context, peak_of(done + k), False, WEIGHTS, 0.0, "decode", k)
        return cap.Probe(
            context, peak_of(done + args.decode), True, WEIGHTS, 0.0, None, None, 0.1, 50.0, 1
        )

    return probe, peak_of


def _args(**kw):
    base = {
        "start": 64,
        "max_context": 1 << 20,
        "tol": (1 / 32, 0),
        "isolate": "none",
        "leak_warn": 0.01,
        "chunk": 32,
        "decode": 8,
    }
    base.update(kw)
    return argparse.Namespace(**base)


def _true_capacity(peak_of, budget, decode, limit):
    """The largest context whose whole run stays within ``budget`` (prefill leaves the last
    token to the first decode step; the peak only grows)."""
    best = 0
    for c in range(2, limit + 1):
        if peak_of(c - 1 + decode) <= budget:
            best = c
    return best


@pytest.mark.parametrize(("per_token", "step"), [(10, 1), (7, 256), (3, 64)])
@pytest.mark.parametrize("budget", [WEIGHTS + 5_000, WEIGHTS + 40_000])
def test_search_brackets_then_bisects_to_the_tolerance(cap, monkeypatch, per_token, step, budget):
    calls: list[int] = []
    probe, peak_of = _fake_probe(cap, per_token, step, calls)
    monkeypatch.setattr(cap, "probe", probe)
    args = _args()
    search = cap.Search("uniform:bits=4", WEIGHTS)
    out = cap.find(None, search, budget, args, lambda msg: None)
    assert out["status"] == "ok"
    best = _true_capacity(peak_of, budget, args.decode, 20_000)
    ctx = out["context"]
    assert ctx <= best  # what it reports fits ...
    assert peak_of(ctx - 1 + args.decode) == out["peak_bytes"] <= budget
    # ... and the shortest context it saw not to fit is within the tolerance above it
    assert ctx < out["next_over"] <= ctx + out["tolerance_tokens"]
    assert out["next_over"] > best
    assert out["tolerance_tokens"] == math.ceil(ctx / 32)
    assert len(calls) == len(set(calls)) <= 12  # no context probed twice
    probes = out["probes"]
    assert [p["context"] for p in probes] == calls
    assert all(p["fits"] == (p["peak_bytes"] <= budget) for p in probes)


def test_search_reuses_finished_probes_for_a_larger_budget(cap, monkeypatch):
    calls: list[int] = []
    probe, _ = _fake_probe(cap, 10, 1, calls)
    monkeypatch.setattr(cap, "probe", probe)
    search = cap.Search("fp16", WEIGHTS)
    small = cap.find(None, search, WEIGHTS + 5_000, _args(), lambda msg: None)
    n = len(calls)
    large = cap.find(None, search, WEIGHTS + 9_000, _args(), lambda msg: None)
    assert large["context"] > small["context"]
    assert calls[n:] and small["context"] not in calls[n:]  # its fit is reused, not rerun
    reused = [p for p in large["probes"] if p["reused"]]
    assert [p["context"] for p in reused] == [small["context"]]


def test_search_reports_a_budget_that_nothing_fits_and_one_that_caps(cap, monkeypatch):
    probe, _ = _fake_probe(cap, 10, 1)
    monkeypatch.setattr(cap, "probe", probe)
    none = cap.find(None, cap.Search("fp16", WEIGHTS), WEIGHTS + 50, _args(), lambda m: None)
    assert none["status"] == "does not fit" and "no context of 16 tokens" in none["reason"]
    assert "context" not in none
    capped = cap.find(
        None, cap.Search("fp16", WEIGHTS), WEIGHTS + 10**9, _args(max_context=4096), lambda m: None
    )
    assert capped["status"] == "ok" and capped["capped"] and capped["context"] == 4096
    assert capped["next_over"] is None


# ---------------------------------------------------------------- ratios and targets


def _row(cache, context, rate, capped=False, budget=16 * 2**30):
    return {
        "shape": "llama3-8b",
        "budget_bytes": budget,
        "cache": cache,
        "status": "ok",
        "context": context,
        "decode_tok_s": rate,
        "capped": capped,
        "peak_bytes": budget - 1,
        "probes": [],
    }


def test_targets_come_from_the_rows(cap):
    rows = [
        _row("fp16", 1000, 10.0),
        _row("uniform:bits=4", 3600, 10.5),  # 3.6x, faster: met
        _row("turboquant:bits=4", 4000, 9.0),  # 4x, slower: not met
        _row("uniform:bits=2", 5000, 12.0),  # 5x < 6x: not met
        _row("kivi:bits=2", 4096, 11.0, capped=True),  # >= 4.1x, capped: undetermined
        _row("turboquant:bits=3.5", 3000, 9.0),  # no target for 3.5 bits
        _row("snapkv:budget=25%+uniform:bits=4", 9000, 8.0),  # eviction: no target
        _row("mlx-q4", 3000, 4.0),  # mlx-lm's cache: no target
        _row("uniform:bits=4", 4000, 20.0, budget=24 * 2**30),  # no fp16 at 24 GiB
    ]
    cap.add_ratios(rows)
    met = [r.get("target", {}).get("met", "none") for r in rows]
    assert met == [
        "none",
        True,
        False,
        False,
        None,
        "none",
        "none",
        "none",
        None,
    ]
    assert rows[1]["x_fp16_context"] == 3.6 and rows[1]["x_fp16_decode"] == 1.05
    assert rows[2]["target"]["context_met"] and rows[2]["target"]["decode_met"] is False
    assert rows[4]["x_fp16_bound"] == ">="
    assert "max-context" in cap.verdict(rows[4])
    assert "no fp16" in rows[8]["target"]["why"]
    assert "x_fp16_context" in rows[7] and "target" not in rows[7]


def test_merge_joins_runs_and_recomputes_the_ratios(cap, tmp_path, capsys):
    first, second, out = tmp_path / "a.json", tmp_path / "b.json", tmp_path / "m.json"
    stale = {**_row("uniform:bits=4", 1000, 1.0), "x_fp16_context": 9.0, "target": {}}
    first.write_text(
        json.dumps({"info": {"device": "gpu"}, "rows": [stale, _row("fp16", 1000, 10.0)]})
    )
    again = [_row("uniform:bits=4", 4000, 12.0), _row("uniform:bits=2", 5000, 9.0)]
    second.write_text(json.dumps({"info": {"device": "gpu"}, "rows": again}))
    assert cap.main(["--merge", str(first), str(second), "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [(r["cache"], r["context"]) for r in rows] == [
        ("fp16", 1000),
        ("uniform:bits=4", 4000),  # the later file's row
        ("uniform:bits=2", 5000),
    ]
    assert rows[1]["x_fp16_context"] == 4.0 and rows[1]["target"]["met"] is True
    assert rows[2]["target"]["met"] is False
    assert "| llama3-8b | 16 GiB | uniform:bits=4 | 4,000 | 4.00 |" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="not a capacity"):
        cap.main(["--merge", str(tmp_path / "none.json")])


def test_sizes_tolerances_and_relative_budgets(cap):
    assert cap.parse_size("16") == cap.parse_size("16G") == 16 * 2**30
    assert cap.parse_size("300M") == cap.parse_size("300MiB") == 300 * MiB
    with pytest.raises(ValueError):
        cap.parse_size("lots")
    assert cap.parse_tolerance("1/32") == (1 / 32, 0)
    assert cap.parse_tolerance("256") == (0.0, 256)
    with pytest.raises(SystemExit):
        cap.parse_tolerance("0")
    assert cap.resolve("snapkv:budget=25%+uniform:bits=4", 4000) == (
        "snapkv:budget=1000+uniform:bits=4"
    )
    assert cap.relative("snapkv:budget=25%") and not cap.relative("snapkv:budget=1024")


def test_bad_arguments_are_refused(cap):
    with pytest.raises(SystemExit):
        cap.main(["--shapes", "nope"])
    with pytest.raises(SystemExit):
        cap.main(["--tiny", "--budgets", "much"])
    with pytest.raises(SystemExit):
        cap.main(["--tiny", "--decode", "1"])


# ---------------------------------------------------------------- a real run on the CPU


def test_tiny_run_finds_each_context_by_real_runs(tmp_path):
    out, chart = tmp_path / "capacity.json", tmp_path / "capacity.svg"
    cmd = [sys.executable, str(ROOT / "benchmarks" / "capacity.py"), "--tiny"]
    cmd += ["--caches", "uniform:bits=4,fp16", "--budgets", "7M,5M", "--decode", "8"]
    cmd += ["--tolerance", "1/16", "--json", str(out), "--chart", str(chart)]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=900, check=False)
    assert res.returncode == 0, res.stderr[-3000:]
    data = json.loads(out.read_text())
    rows = data["rows"]
    # budgets ascending, fp16 first in each
    assert [(r["budget_bytes"] // MiB, r["cache"]) for r in rows] == [
        (5, "fp16"),
        (5, "uniform:bits=4"),
        (7, "fp16"),
        (7, "uniform:bits=4"),
    ]
    limit = data["info"]["max_context"]
    for r in rows:
        assert r["status"] == "ok", r
        budget = r["budget_bytes"]
        # weights included: the peak holds them, and stays within the budget at the context
        assert 0 < r["weights_bytes"] < r["peak_bytes"] <= budget
        assert r["decode_tok_s"] > 0 and r["cache_bytes"] > 0
        fit = [p for p in r["probes"] if p["context"] == r["context"]]
        assert fit and fit[0]["fits"] and fit[0]["peak_bytes"] == r["peak_bytes"]
        for p in r["probes"]:  # each probe's verdict is its own measured peak's
            assert p["fits"] == (p.get("stopped") is None and p["peak_bytes"] <= budget)
            assert p["fits"] or p["peak_bytes"] > budget
        if r["capped"]:
            assert r["context"] == limit
            continue
        # context + tolerance does not fit: a probe ran past the budget at or below it
        assert r["context"] < r["next_over"] <= r["context"] + r["tolerance_tokens"]
        over = [
            p
            for p in r["probes"]
            if not p["fits"]
            and (
                p["context"] == r["next_over"]
                or (p.get("stopped") == "prefill" and p["stopped_at"] + 1 == r["next_over"])
            )
        ]
        assert over, r["probes"]
    for budget in (5 * MiB, 7 * MiB):
        fp16, u4 = (r for r in rows if r["budget_bytes"] == budget)
        assert u4["context"] > fp16["context"]  # the 4-bit codes reach further
        assert u4["x_fp16_context"] == u4["context"] / fp16["context"]
        ratio_ok = u4["x_fp16_context"] >= 3.5
        rate_ok = u4["x_fp16_decode"] >= 1.0
        assert u4["target"]["met"] == (ratio_ok and rate_ok)
    assert chart.read_text().lstrip().startswith("<?xml")
    assert "| tiny | 5 MiB | fp16 |" in res.stdout and "issue 52 targets" in res.stdout


# ---------------------------------------------------------------- --fill direct


@pytest.mark.parametrize("spec", ["fp16", "uniform:bits=4", "kivi:bits=2"])
def test_direct_fill_stores_what_the_prefill_stores_and_peaks_alike(cap, spec):
    """``--fill direct`` writes the prompt's first tokens into the caches instead of running
    the model over them: the cache holds the same bytes, the run peaks within a few percent
    of the model's prefill, and the decode still runs through the model."""
    model = cap.e2e.build_model("tiny", "fp32")
    args = argparse.Namespace(shape="tiny", weights="fp32", decode=8, chunk=64, seed=0)
    runs = {}
    for fill in ("model", "direct"):
        args.fill = fill
        runs[fill] = cap.probe(model, spec, 1200, 1 << 40, args)
    model_run, direct = runs["model"], runs["direct"]
    assert model_run.fill == "model" and direct.fill == "direct" and direct.fill_s > 0
    assert direct.fits and direct.decode_tok_s > 0
    assert direct.cache_bytes == model_run.cache_bytes
    assert abs(direct.peak_bytes - model_run.peak_bytes) <= 0.05 * model_run.peak_bytes


def test_direct_fill_leaves_the_last_two_chunks_and_eviction_to_the_model(cap):
    args = argparse.Namespace(fill="direct", chunk=64)
    plain = [type("Cache", (), {"policy": None})()]
    evicting = [type("Cache", (), {"policy": object()})()]
    # a prompt of 1,200 tokens prefills 1,199 in chunks starting 0, 64, ..., 1152
    assert cap.direct_tokens(plain, 1200, args) == 1088
    assert cap.direct_tokens(plain, 1153, args) == 1024  # chunks ..., 1024, 1088 (64 tokens)
    assert cap.direct_tokens(plain, 129, args) == 0  # two chunks: the model runs both
    assert cap.direct_tokens(evicting, 1200, args) == 0
    args.fill = "model"
    assert cap.direct_tokens(plain, 1200, args) == 0


def test_direct_fill_stops_once_the_peak_passes_the_budget(cap):
    model = cap.e2e.build_model("tiny", "fp32")
    args = argparse.Namespace(shape="tiny", weights="fp32", decode=8, chunk=64, seed=0)
    args.fill = "direct"
    p = cap.probe(model, "fp16", 4000, 6 * MiB, args)
    assert not p.fits and p.stopped == "prefill" and p.stopped_at < 4000
    assert p.over_from("fp16") == p.stopped_at + 1


def test_rows_found_so_far_are_kept_beside_the_json(cap, tmp_path):
    args = argparse.Namespace(json=tmp_path / "run.json", weights="4bit", decode=8, fill="direct")
    args.rows_before = [{"cache": "fp16"}]
    cap.checkpoint(args, [{"cache": "uniform:bits=4"}])
    data = json.loads((tmp_path / "run.json.partial").read_text())
    assert [r["cache"] for r in data["rows"]] == ["fp16", "uniform:bits=4"]
    assert data["info"]["partial"] and data["info"]["fill"] == "direct"
    args.json = None
    cap.checkpoint(args, [])  # no --json: nothing written
