"""The long-context suite with every package installed: eviction methods with budgets as
shares of the prompt and a composition, the question after the compressed context and
inside it, on the reference model (the suite's small version; the grid is a benchmark)."""

import pytest

from velox_cli.data import find_shared
from velox_cli.longctx.grid import POINTS, default_specs
from velox_cli.longctx.run import EvalSettings, aggregate, run_eval, spec_check


def test_every_default_spec_parses_with_all_packages():
    specs = default_specs(list(POINTS))
    for s in specs:
        spec_check(s)
    assert "snapkv:budget=25%" in specs and "snapkv:budget=25%+uniform:bits=4" in specs


@pytest.mark.parametrize("question", ["after", "inside"])
def test_eviction_and_composition_on_the_reference_model(question):
    if find_shared("reference-model") is None:
        pytest.skip("the reference model (shared/reference-model) is not here")
    specs = [
        spec_check(t)
        for t in (
            "fp16",
            "snapkv:budget=25%",
            "streamingllm:budget=25%",
            "snapkv:budget=50%+uniform:bits=4",
        )
    ]
    trials, info = run_eval(
        specs,
        None,
        EvalSettings(
            tasks=["multikey:keys=2"], lengths=[512], prompts=1, question=question, jobs=1
        ),
    )
    cells = {c.spec: c for c in aggregate(trials)}
    assert info["question"] == question
    assert all(c.errors == 0 and c.prompts == 1 for c in cells.values()), [
        c.error for c in cells.values()
    ]
    # a quarter of the prompt's tokens kept (plus the window and the question's tokens)
    assert 2.0 < cells["snapkv:budget=25%"].ratio < 4.5
    assert 2.0 < cells["streamingllm:budget=25%"].ratio < 4.5
    # half the tokens at 4 bits: more than either alone
    assert cells["snapkv:budget=50%+uniform:bits=4"].ratio > cells["snapkv:budget=25%"].ratio
