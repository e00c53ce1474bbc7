"""velox allocate: measures, allocates, writes a file velox bench / eval / generate take as a
spec; its bytes are the ones bench then measures; bad input is one line and exit code 2."""

import contextlib
import io
import json

import pytest
from refused import assert_refused

from velox_cli.allocate import tail_prompts
from velox_cli.allocation import Allocation, SensitivityTable
from velox_cli.main import main
from velox_cli.specs import ALLOCATION, build_caches, parse
from velox_core import UniformCache
from velox_testing import tiny_model

SPECS = ["uniform:bits=2", "uniform:bits=8"]


@pytest.fixture(scope="module")
def allocated(model_dir, text_file, tmp_path_factory):
    """One measurement on the tiny model: the allocation at uniform:bits=4's bytes (a spec
    measured for its bytes only, not a candidate) and the table."""
    d = tmp_path_factory.mktemp("allocate")
    argv = ["allocate", "--model", model_dir, "--data", text_file, "--budget", "uniform:bits=4"]
    argv += ["--specs", *SPECS, "--prompts", "2", "--context", "96", "--tail", "8"]
    argv += ["--chunk", "32", "--json", str(d / "a.json"), "--table", str(d / "t.json")]
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        assert main(argv) == 0
    (d / "printed.txt").write_text(printed.getvalue())
    return d / "a.json", d / "t.json"


def test_allocate_writes_an_allocation_and_its_table(allocated):
    plan_path, table_path = allocated
    plan = Allocation.load(plan_path)
    table = SensitivityTable.load(table_path)
    assert table.specs == [*SPECS, "uniform:bits=4"] and table.layers == [0, 1]
    assert table.prompts == 2 and table.tail == 8 and table.tokens == 96 + 8 - 1
    assert set(plan.layers.values()) <= set(SPECS) and plan.specs == SPECS
    four = sum(r[2] for r in table.held)
    assert plan.budget == pytest.approx(four) and plan.bytes_per_token <= four
    chosen = [table.held[i][SPECS.index(plan.layers[k])] for i, k in enumerate(table.layers)]
    assert plan.bytes_per_token == pytest.approx(sum(chosen))
    printed = (plan_path.parent / "printed.txt").read_text()
    rows = [line for line in printed.splitlines() if line.split()[0].isdigit()]
    assert len(rows) == 2 and all(r.count("*") == 1 for r in rows)  # each layer's choice
    assert "summed KL" in printed
    assert f"allocation written to {plan_path}" in printed
    assert plan.info["budget_asked"] == "uniform:bits=4"
    assert table.info["candidates"] == SPECS and table.info["context"] == 96


def test_bench_measures_the_allocation_at_the_bytes_allocate_predicted(
    allocated, model_dir, text_file, tmp_path
):
    """velox bench takes the file as a spec; at the table's length (context + continuation =
    context + tail) and prefill chunk its held bytes per token are the predicted ones, and the
    layers hold the chosen specs."""
    plan_path, _ = allocated
    plan = Allocation.load(plan_path)
    out = tmp_path / "rows.json"
    argv = ["bench", "--model", model_dir, "--data", text_file, "--context", "96"]
    argv += ["--continuation", "8", "--chunk", "32", "--methods", "uniform:bits=4", str(plan_path)]
    assert main([*argv, "--jobs", "1", "--json", str(out), "--chart", ""]) == 0
    four, mixed = json.loads(out.read_text())
    assert mixed["error"] is None and mixed["spec"] == str(plan_path)
    assert mixed["method"] == ALLOCATION
    assert mixed["params"]["layers"] == {str(k): v for k, v in plan.layers.items()}
    assert mixed["bytes_per_token"] == pytest.approx(plan.bytes_per_token, rel=1e-9)
    assert mixed["bytes_per_token"] <= four["bytes_per_token"] * (1 + 1e-9)
    assert mixed["kl"] > 0


def test_eval_and_generate_take_the_allocation(allocated, model_dir, tmp_path, capsys):
    plan_path, _ = allocated
    out = tmp_path / "eval.json"
    argv = ["eval", "--model", model_dir, "--methods", str(plan_path), "--tasks", "passkey"]
    argv += ["--lengths", "256", "--prompts", "1", "--jobs", "1", "--chart", ""]
    assert main([*argv, "--json", str(out)]) == 0
    trials = json.loads(out.read_text())["trials"]
    mine = [t for t in trials if t["spec"] == str(plan_path)]
    assert mine and all(t["error"] is None and t["bytes"] > 0 for t in mine)
    argv = ["generate", "--model", model_dir, "--method", str(plan_path), "--max-tokens", "3"]
    assert main(argv) == 0
    assert f"[velox] {plan_path}:" in capsys.readouterr().out


def test_an_allocation_spec_builds_each_layers_cache(tmp_path):
    model = tiny_model("llama", num_hidden_layers=3)
    path = tmp_path / "hand.json"
    doc = {"default": "uniform:bits=4", "layers": {"0": "fp16", "-1": "mlx-q8"}}
    path.write_text(json.dumps(doc))
    spec = parse(str(path))
    assert spec.name == ALLOCATION and spec.params["layers"] == {"0": "fp16", "-1": "mlx-q8"}
    import mlx.core as mx
    from mlx_lm.models.cache import QuantizedKVCache

    from velox_cli.specs import StoredKVCache

    caches = build_caches(spec, model, mx.float16)
    assert isinstance(caches[0], StoredKVCache) and isinstance(caches[1], UniformCache)
    assert isinstance(caches[2], QuantizedKVCache) and caches[2].bits == 8
    assert caches[1].storage_dtype == mx.float16


@pytest.mark.parametrize(
    "doc,needle",
    [
        ({"default": "uniform:bits=4", "layers": {"0": "nope:bits=2"}}, "layer 0"),
        ({"default": "uniform:bitz=4", "layers": {}}, "default"),
        ({"default": "x.json", "layers": {}}, "cannot be allocations"),
        ({"default": "uniform:bits=4", "layers": {"zero": "fp16"}}, "'index': 'spec'"),
    ],
)
def test_bad_allocation_files_are_refused_by_bench(doc, needle, tmp_path, capsys):
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(doc))
    assert_refused(["bench", "--methods", str(path)], needle, capsys)


def test_from_table_allocates_again_without_measuring(allocated, capsys):
    _, table_path = allocated
    capsys.readouterr()
    assert main(["allocate", "--from-table", str(table_path), "--budget", "2bits"]) == 2
    assert "below the cheapest allocation" in capsys.readouterr().err
    argv = ["allocate", "--from-table", str(table_path), "--budget", "uniform:bits=8"]
    assert main([*argv, "--json", "-"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["format"] == "velox-allocation" and doc["layers"] == {"0": "uniform:bits=8"} | {
        "1": "uniform:bits=8"
    }
    argv[-1] = "uniform:bits=4"  # measured for its bytes only: not a choice
    assert main([*argv, "--json", "-"]) == 0
    assert set(json.loads(capsys.readouterr().out)["layers"].values()) <= set(SPECS)
    assert main([*argv, "--specs", "uniform:bits=2"]) == 0
    printed = capsys.readouterr().out
    assert "make_cache(model, 'uniform:bits=2', layers={})" in printed
    assert "*" in printed and "summed KL" in printed


@pytest.mark.parametrize(
    "extra,needle",
    [
        (["--budget", "lots", "--from-table", "T"], "give bytes per token"),
        (["--budget", "3bits", "--from-table", "T", "--model", "m"], "--model apply only"),
        (["--budget", "3bits", "--from-table", "T", "--prompts", "2"], "--prompts apply only"),
        (["--budget", "3bits", "--prompts", "0"], "--prompts must be a positive"),
        (["--budget", "3bits", "--specs", "mlx-q4"], "not a velox method's spec"),
        (["--budget", "3bits", "--specs", "a.json"], "not a velox method's spec"),
        (["--budget", "3bits", "--from-table", "/no/such.json"], "no such file"),
        (["--budget", "-1", "--from-table", "T"], "positive"),
        (["--budget", "3bits", "--from-table", "T", "--specs", "uniform:bits=5"], "not in"),
        (["--specs", "fp16"], "--budget"),
        # checked before the model loads (no such model): named at once, not after measuring
        (["--budget", "3bits", "--specs", "nope:bits=2", "--model", "/no/such"], "unknown method"),
    ],
)
def test_bad_input_is_one_line_and_exit_code_2(extra, needle, allocated, capsys):
    _, table_path = allocated
    assert_refused(
        ["allocate", *[str(table_path) if x == "T" else x for x in extra]], needle, capsys
    )


@pytest.mark.parametrize(
    "budget,needle",
    [
        ("0", "--budget must be a positive number"),
        ("inf", "--budget must be a positive number"),
        ("0bits", "NNbits takes a positive number"),
        ("threebits", "NNbits takes a positive number"),
        ("uniform:bitz=3", "no parameter 'bitz'"),
        ("mlx-q4", "not a velox method's spec"),
    ],
)
def test_a_bad_budget_is_named_before_the_model_loads(budget, needle, capsys):
    """With no such model: the bad budget is named at once, not after measuring."""
    assert_refused(["allocate", "--budget", budget, "--model", "/no/such"], needle, capsys)


def test_prompts_come_from_the_end_of_the_text_without_overlap():
    stream = list(range(100))
    want = [list(range(90, 100)), list(range(80, 90)), list(range(70, 80))]
    assert tail_prompts(stream, 3, 10) == want
    with pytest.raises(ValueError, match="the text has 100 tokens; 3 prompts of 40 need 120"):
        tail_prompts(stream, 3, 40)
