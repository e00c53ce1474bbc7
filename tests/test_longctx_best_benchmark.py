"""benchmarks/longctx_best.py: the best setting of each method at 4x, 8x and 16x, from
``velox eval`` JSON files (synthetic trials written as ``velox eval --json`` writes them)."""

import math

import pytest

from velox_cli.longctx import report
from velox_cli.longctx.cells import Trial


@pytest.fixture(scope="module")
def best(load_benchmark):
    return load_benchmark("longctx_best")


def _trials(scores: dict[str, list[float]], ratio: dict[str, float], n_done=None):
    """Trials of one task at one length: ``scores[spec][i]`` on prompt i; fp16 holds 1000
    bytes, a spec 1000 / its ratio; ``n_done[spec]`` prompts finished (default all)."""
    out = []
    for spec, ss in scores.items():
        for i, s in enumerate(ss[: (n_done or {}).get(spec, len(ss))]):
            b = round(1000 / ratio.get(spec, 1.0))
            out.append(Trial(spec, "passkey", 4096, i, 0.0, 4096, s, "", 0.0, 1.0, bytes=b))
    return out


def _write(tmp_path, name, trials, question="after"):
    p = tmp_path / name
    report.write_json(str(p), trials, {"model": "m", "question": question})
    return str(p)


def test_method_and_point(best):
    assert best.method_of("snapkv:budget=25%,kernel=15+turboquant:bits=4") == "snapkv+turboquant"
    assert best.method_of("kivi:bits=4") == "kivi" and best.method_of("fp16") == "fp16"
    assert [best.point_of(r) for r in (2.9, 3.0, 5.99, 6.0, 11.9, 12.0, 40.0)] == [
        None,
        "4x",
        "4x",
        "8x",
        "8x",
        "16x",
        "16x",
    ]


def test_best_row_per_method_and_point_across_runs(tmp_path, best):
    fp16 = [1.0, 1.0, 0.0, 1.0]
    a = _write(
        tmp_path,
        "a.json",
        _trials(
            {"fp16": fp16, "kivi:bits=4": [1.0, 0.0, 0.0, 1.0], "kivi:bits=2": [1, 1, 0, 1]},
            {"kivi:bits=4": 4.0, "kivi:bits=2": 7.0},
        ),
    )
    b = _write(
        tmp_path,
        "b.json",
        _trials({"fp16": fp16, "kivi:bits=4,group=64": fp16}, {"kivi:bits=4,group=64": 3.5}),
        question="inside",
    )
    c = _write(  # kivi:bits=4 again on fewer prompts, answering better: not taken
        tmp_path,
        "c.json",
        _trials({"fp16": fp16[:2], "kivi:bits=4": fp16[:2]}, {"kivi:bits=4": 4.0}),
    )
    rows = best.entries(a) + best.entries(b) + best.entries(c)
    assert {e.spec for e in rows} == {"kivi:bits=4", "kivi:bits=2", "kivi:bits=4,group=64"}
    e = next(e for e in rows if e.spec == "kivi:bits=4" and e.run == "a.json")
    assert e.delta == pytest.approx(-0.25) and e.ratio == pytest.approx(4.0, rel=1e-2)
    table = best.best(rows)
    assert table["kivi"]["4x"].spec == "kivi:bits=4,group=64"  # +0.00 beats -0.25
    assert best.best(best.entries(a) + best.entries(c))["kivi"]["4x"].run == "a.json"
    assert table["kivi"]["4x"].question == "inside" and table["kivi"]["4x"].run == "b.json"
    assert table["kivi"]["8x"].spec == "kivi:bits=2" and "16x" not in table["kivi"]
    md = best.markdown(table, compact=True)
    assert "| kivi | +0 (i) | +0 | - |" in md


def test_a_spec_is_compared_on_the_prompts_it_finished(tmp_path, best):
    # the spec finished 2 of 4 prompts: fp16's other two do not enter its difference
    path = _write(
        tmp_path,
        "c.json",
        _trials(
            {"fp16": [1.0, 1.0, 0.0, 0.0], "snapkv:budget=25%": [1.0, 1.0, 0.0, 0.0]},
            {"snapkv:budget=25%": 4.0},
            n_done={"snapkv:budget=25%": 2},
        ),
    )
    (e,) = best.entries(path)
    assert e.delta == 0.0 and e.prompts == 2
    assert math.isfinite(e.ratio)


def test_a_run_without_fp16_is_refused(tmp_path, best):
    path = _write(tmp_path, "d.json", _trials({"kivi:bits=4": [1.0]}, {}))
    with pytest.raises(ValueError, match="no fp16"):
        best.entries(path)


def test_drop_leaves_out_a_methods_rows_of_one_run(tmp_path, best, capsys):
    fp16 = [1.0, 1.0]
    a = _write(
        tmp_path,
        "a.json",
        _trials(
            {"fp16": fp16, "h2o:budget=25%,recent=8": [0.0, 0.0]}, {"h2o:budget=25%,recent=8": 4.0}
        ),
    )
    b = _write(
        tmp_path,
        "b.json",
        _trials({"fp16": fp16, "h2o:budget=25%": [1.0, 0.0]}, {"h2o:budget=25%": 4.0}),
    )
    best.main([a, b, "--compact"])
    assert "| h2o | -50 | - | - |" in capsys.readouterr().out
    best.main([a, b, "--compact", "--drop", "b.json:h2o"])
    assert "| h2o | -100 | - | - |" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        best.main([a, "--drop", "h2o"])
