"""benchmarks/gemma3_long_check.py's MLX half and helpers, on a tiny random Gemma 3 (sliding
window 16, every second layer global) and the suite's own prompts: its prefill is the one
``velox eval`` gives fp16 (same last logits and greedy tokens), and its logits at sampled
positions are those of one uncached forward of the whole prompt."""

import json
from types import SimpleNamespace

import mlx.core as mx
import numpy as np
import pytest

from velox_cli.evaluate import greedy
from velox_cli.longctx.run import prompt_caches, spread_order
from velox_cli.longctx.tasks import make_prompts
from velox_cli.specs import Spec, build_caches
from velox_core import routed
from velox_testing import tiny_model
from velox_testing.models import tiny_tokenizer

SETTINGS = SimpleNamespace(haystack="noise", template="raw", question="after", chunk=64, seed=0)


@pytest.fixture(scope="module")
def check(load_benchmark):
    return load_benchmark("gemma3_long_check")


@pytest.fixture(scope="module")
def tok():
    return tiny_tokenizer()


@pytest.mark.parametrize("question", ["after", "inside"])
def test_mlx_side_prefills_as_velox_eval_and_matches_one_forward(check, tok, question):
    model = tiny_model("gemma3", dtype=mx.float32)
    (prompt,) = make_prompts(tok, "multikey:keys=2", 1024, 1, haystack="noise")
    ids = prompt.context + prompt.question
    assert len(ids) > 4 * SETTINGS.chunk  # several chunks, each wider than the window (16)
    at = check.spread_positions(len(ids), 5)
    logits, out = check.mlx_side(model, prompt, at, question, SETTINGS.chunk)

    caches = build_caches(Spec("fp16", "fp16"), model, None)
    with routed(model):
        last = prompt_caches(model, caches, prompt, question, SETTINGS.chunk)
        want = greedy(model, caches, last, prompt.max_new)
    assert out == want
    np.testing.assert_allclose(logits[-1], np.array(last[0]), atol=1e-4)

    whole = model(mx.array(ids)[None])[0, mx.array(at)]  # no cache: the masks alone
    np.testing.assert_allclose(logits, np.array(whole), atol=1e-4)


def test_pieces_follow_the_question_mode(check):
    p = SimpleNamespace(context=list(range(10)), question=[10, 11, 12])
    assert check._pieces(p, "after", 4) == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9], [10, 11, 12]]
    assert check._pieces(p, "inside", 4) == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11], [12]]


def test_positions_split_and_compare(check):
    assert check.spread_positions(100, 4) == [25, 50, 74, 99]
    assert check.spread_positions(3, 8) == [0, 1, 2]
    with pytest.raises(ValueError, match="positions must be positive"):
        check.spread_positions(100, 0)
    assert check.first_split([1, 2, 3], [1, 2, 3]) is None
    assert check.first_split([1, 2, 3], [1, 5, 3]) == 1
    assert check.first_split([1, 2], [1, 2, 3]) == 2
    ours = np.array([[0.0, 2.0, 1.0], [3.0, 0.0, 0.0]])
    theirs = np.array([[0.0, 1.5, 1.0], [0.0, 0.5, 0.0]])
    got = check.compare(ours, theirs)
    assert got["max_abs_diff"] == [0.5, 3.0] and got["argmax_agree"] == [True, False]
    assert got["argmax_agree_all"] == 1 and got["max_abs_diff_all"] == 3.0


def test_prompts_are_velox_evals_in_its_order(check, tok):
    made = make_prompts(tok, "passkey", 1024, 5, haystack="noise")
    picked = check.pick_prompts(tok, "passkey", 1024, 3, 5, SETTINGS)
    assert [i for i, _ in picked] == spread_order(5)[:3] == [0, 4, 2]
    assert [p.context for _, p in picked] == [made[i].context for i in (0, 4, 2)]
    with pytest.raises(ValueError, match=r"--prompts must be in \[1, --of\]"):
        check.pick_prompts(tok, "passkey", 1024, 6, 5, SETTINGS)


def test_gpu_answers_only_from_runs_of_the_same_prompts(check, tmp_path):
    run = {"haystack": "noise", "template": "raw", "question": "after", "chunk": 64, "seed": 0}
    trials = [
        {"spec": "fp16", "task": "passkey", "length": 300, "index": 2, "output": "x", "score": 0},
        {"spec": "kivi", "task": "passkey", "length": 300, "index": 2, "output": "y", "score": 1},
    ]
    same = tmp_path / "same.json"
    same.write_text(json.dumps({"run": {**run, "prompts": 5}, "trials": trials}))
    other = tmp_path / "other.json"
    other.write_text(json.dumps({"run": {**run, "seed": 1, "prompts": 5}, "trials": trials}))
    got = check.gpu_answers([str(same), str(other)], SETTINGS, {"passkey": 5})
    assert got == {("passkey", 300, 2): ("x", 0, "same.json")}
    assert check.gpu_answers([str(same)], SETTINGS, {"passkey": 8}) == {}
