"""The long-context suite: task generation, scoring, byte counting, and ``velox eval``'s
small version on the reference model (one short task, a few prompts)."""

import itertools
import json
import math
import re
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import KVCache, QuantizedKVCache, RotatingKVCache

from velox_cli.data import find_shared
from velox_cli.longctx import report
from velox_cli.longctx.grid import POINTS, default_specs, fit_groups
from velox_cli.longctx.run import (
    EvalSettings,
    Trial,
    aggregate,
    held_bytes,
    prompt_caches,
    resolve_spec,
    spec_check,
    spread_order,
    wilson,
)
from velox_cli.longctx.tasks import TASKS, make_prompts, parse_task, score
from velox_cli.main import main
from velox_core import make, make_cache, routed
from velox_testing.models import _tokenizer


@pytest.fixture(scope="module")
def tok():
    return _tokenizer()


@pytest.mark.parametrize("task", list(TASKS))
@pytest.mark.parametrize("haystack", ["prose", "code", "noise"])
def test_prompts_have_the_length_asked_and_hold_every_answer(tok, task, haystack):
    n = 2048 if task == "cwe" else 1024  # its solved example takes ~1,000 bytes
    ps = make_prompts(tok, task, n, 3, haystack=haystack, seed=1)
    assert [p.depth for p in ps] == [0.0, 0.5, 1.0]
    for p in ps:
        assert n * 0.8 <= p.tokens <= n + 8, p.tokens  # whole sentences or lines
        ctx = tok.decode(p.context)
        for a in p.answers:  # every expected string is in the context, the question ends it
            assert a in ctx
        assert p.text.endswith(tok.decode(p.question).lstrip("\n")) or p.question
        assert p.max_new >= 4


def test_prompts_are_seeded_and_differ_by_seed(tok):
    a = make_prompts(tok, "multikey", 1024, 2, seed=3)
    b = make_prompts(tok, "multikey", 1024, 2, seed=3)
    c = make_prompts(tok, "multikey", 1024, 2, seed=4)
    assert [p.context for p in a] == [p.context for p in b]
    assert [p.answers for p in a] != [p.answers for p in c]


def test_needle_depth_moves_the_needle(tok):
    first, last = make_prompts(tok, "passkey", 2048, 2)
    v0, v1 = first.answers[0], last.answers[0]
    assert first.text.index(v0) < len(first.text) * 0.1
    assert last.text.index(v1) > len(last.text) * 0.8


def test_multikey_asks_one_key_among_distractors(tok):
    (p,) = make_prompts(tok, "multikey:keys=5", 1024, 1)
    assert len(re.findall(r"special magic numbers for [a-z]+-[a-z]+ is", p.text)) == 5
    assert len(p.answers) == 1


def test_vartrack_chain_leads_to_the_value(tok):
    (p,) = make_prompts(tok, "vartrack:hops=3,chains=2", 1024, 1)
    assigns = dict(re.findall(r"VAR ([A-Z]+) = (VAR [A-Z]+|\d+)\.", p.text))
    assert len(assigns) == 8
    for name in p.answers:  # every asked variable resolves to the asked value
        v = assigns[name]
        while v.startswith("VAR "):
            v = assigns[v[4:]]
        assert f"value {v} " in p.text


def test_cwe_answers_are_the_most_frequent_words(tok):
    (p,) = make_prompts(tok, "cwe:common=3,freq=10,rare=2", 2048, 1)
    listing = p.text.rsplit("Memorize the ones that appear most often.", 1)[1]
    words = re.findall(r"^\d+\. (\w+)$", listing, flags=re.M)
    counts = {w: words.count(w) for w in set(words)}
    top = sorted(counts, key=lambda w: -counts[w])[:3]
    assert sorted(top) == sorted(p.answers)
    assert all(counts[w] == 10 for w in p.answers)


@pytest.mark.parametrize(
    "text, msg",
    [
        ("needle", "unknown task"),
        ("passkey:keys=3", "bad parameter"),
        ("multikey:keys=x", "must be an integer"),
        ("passkey:digits=1", "must be in"),
        ("multiquery:keys=2,queries=3", "cannot exceed"),
    ],
)
def test_bad_tasks_are_refused(text, msg):
    with pytest.raises(ValueError, match=msg):
        parse_task(text)


def test_a_length_too_short_for_the_task_is_refused(tok):
    with pytest.raises(ValueError, match="cannot hold"):
        make_prompts(tok, "cwe", 512, 1)
    with pytest.raises(ValueError, match="cannot hold"):
        make_prompts(tok, "multivalue:values=16,digits=9", 256, 1)


def test_score_is_rulers_string_match():
    assert score("The pass key is 12345.", ["12345"]) == 1.0
    assert score("123456", ["12345"]) == 0.0  # a number must stand alone
    assert score("111, 333", ["111", "222", "333", "444"]) == 0.5
    assert score("Apple and PEAR", ["apple", "pear"]) == 1.0


def test_budget_shares_resolve_per_prompt():
    assert resolve_spec("snapkv:budget=25%", 4000) == "snapkv:budget=1000"
    assert resolve_spec("snapkv:budget=50%+uniform:bits=4", 1000) == (
        "snapkv:budget=500+uniform:bits=4"
    )
    assert resolve_spec("uniform:bits=4", 1000) == "uniform:bits=4"
    with pytest.raises(ValueError, match="budget share"):
        spec_check("snapkv:budget=0%")
    with pytest.raises(ValueError):
        spec_check("nosuchmethod:bits=4")


def test_default_specs_are_valid_and_cover_each_point():
    specs = default_specs(["4x", "8x", "16x"])
    assert specs[:3] == ["fp16", "mlx-q8", "mlx-q4"]
    for s in specs:
        spec_check(s)
    assert "uniform:bits=4" in specs and "uniform:bits=2" in specs
    assert set(POINTS) == {"4x", "8x", "16x"}
    with pytest.raises(ValueError, match="operating point"):
        default_specs(["3x"])


def test_default_specs_leave_mlx_lm_quantized_caches_out_on_cuda():
    cpu, cuda = default_specs(["4x"], backend="cpu"), default_specs(["4x"], backend="cuda")
    assert cpu[:3] == ["fp16", "mlx-q8", "mlx-q4"] and cpu == default_specs(["4x"])
    assert cuda == [s for s in cpu if s not in ("mlx-q8", "mlx-q4")]


def test_default_specs_fit_their_channel_groups_to_the_head_dim():
    assert fit_groups("qjl:group=128,window=384", 64) == "qjl:group=64,window=384"
    assert fit_groups("skvq:key_group=64,value_group=128", 64) == (
        "skvq:key_group=64,value_group=64"
    )
    assert fit_groups("skvq:key_group=64,value_group=128", 96) == (
        "skvq:key_group=32,value_group=32"
    )
    assert fit_groups("kivi:group=32", 64) == "kivi:group=32"
    # xKV's layer_group counts layers, not channels
    assert fit_groups("xkv:layer_group=2,key_rank=192", 64) == "xkv:layer_group=2,key_rank=192"
    specs = default_specs(["4x", "8x"], head_dim=64)
    for s in specs:
        spec_check(s)
        for g in re.findall(r"(?<![a-z_])(?:key_|value_)?group=(\d+)", s):
            assert 64 % int(g) == 0, s
    assert default_specs(["4x"], head_dim=128) == default_specs(["4x"])


def test_spread_order_spreads_every_prefix_over_the_depths():
    for n in (1, 2, 3, 8, 16, 17):
        order = spread_order(n)
        assert sorted(order) == list(range(n))
    order = spread_order(16)
    assert order[:2] == [0, 15]
    for k in range(3, 17):  # any prefix leaves no gap wider than twice the even spacing
        taken = sorted(order[:k])
        assert max(b - a for a, b in itertools.pairwise(taken)) <= 2 * 15 / (k - 1) + 1


def test_errors_are_footnotes_not_part_of_the_spec_column():
    long = "ValueError: " + "a long explanation " * 20
    ts = [Trial("fp16", "passkey", 512, 0, 0.0, 500, score=1.0, kl=0.0, top1=1.0, bytes=1000)]
    ts += [Trial(f"m{k}", "passkey", 512, 0, 0.0, 500, error=long) for k in range(2)]
    md = report.markdown(aggregate(ts))
    rows = [line for line in md.splitlines() if line.startswith("| `m")]
    assert len(rows) == 2 and all("(1 errors [1])" in r and long not in r for r in rows)
    assert f"[1] {long}" in md and md.count(long) == 1


def test_held_bytes_counts_every_cache_class_by_its_tokens():
    k = mx.random.normal((1, 2, 300, 64)).astype(mx.float16)
    fp = KVCache()
    fp.update_and_fetch(k, k)
    assert fp.nbytes > held_bytes(fp) == 2 * k.nbytes  # mlx-lm allocates 256 at a time
    q = QuantizedKVCache(group_size=64, bits=4)
    q.update_and_fetch(k, k)
    per_token = 2 * 2 * (64 * 4 // 8 + 2 * 2)  # K and V, 2 heads: 4-bit codes, fp16 scale, bias
    assert held_bytes(q) == 300 * per_token
    r = RotatingKVCache(max_size=128)
    r.update_and_fetch(k[..., :1, :], k[..., :1, :])
    for _ in range(200):
        r.update_and_fetch(k[..., :1, :], k[..., :1, :])
    assert held_bytes(r) == 2 * 128 * 2 * 64 * 2
    v = make("uniform:bits=4")
    v.update_and_fetch(k, k)
    assert held_bytes(v) == v.logical_nbytes


def test_wilson_interval():
    lo, hi = wilson(0.9, 100)
    assert 0.82 < lo < 0.84 and 0.94 < hi < 0.95
    assert wilson(1.0, 10)[1] == 1.0
    assert wilson(0.0, 10)[0] == 0.0


def test_aggregate_ratio_and_errors():
    ts = [
        Trial("fp16", "passkey", 512, i, 0.0, 500, score=1.0, kl=0.0, top1=1.0, bytes=1000)
        for i in range(2)
    ]
    ts += [
        Trial("a", "passkey", 512, 0, 0.0, 500, score=1.0, kl=0.1, top1=0.5, bytes=250),
        Trial("a", "passkey", 512, 1, 0.0, 500, score=0.0, kl=0.3, top1=0.5, bytes=500),
        Trial("b", "passkey", 512, 0, 0.0, 500, error="ValueError: x"),
    ]
    cells = {c.spec: c for c in aggregate(ts)}
    assert cells["fp16"].ratio == 1.0 and cells["fp16"].accuracy == 1.0
    assert cells["a"].ratio == pytest.approx(3.0) and cells["a"].accuracy == 0.5
    assert cells["a"].kl == pytest.approx(0.2)
    assert cells["b"].errors == 1 and cells["b"].prompts == 0 and "ValueError" in cells["b"].error
    # a run stopped midway may hold a spec's trial on a prompt without fp16's: no ratio there
    late = Trial("a", "passkey", 512, 7, 0.0, 500, score=1.0, kl=0.1, top1=0.5, bytes=250)
    cells = {c.spec: c for c in aggregate([*ts, late])}
    assert cells["a"].prompts == 3 and cells["a"].ratio == pytest.approx(3.0)
    assert math.isnan(aggregate([late])[0].ratio)
    assert math.isnan(cells["a"].layers_ratio)  # no sliding-window layers: one ratio
    assert "layers" not in report.markdown(aggregate(ts))


def test_paired_delta_and_its_interval():
    """delta's interval pairs each prompt with fp16's answer on it: a spec that answers
    exactly fp16's prompts has delta 0 +- 0, where two separate Wilson intervals at 0.5 over
    ten prompts span +-30 points; one flipped prompt of ten gives the t-free normal interval
    of the mean difference."""
    from velox_cli.longctx.report import paired_half, summary

    kw = dict(kl=0.0, top1=1.0, bytes=100)
    scores = [1.0, 0.0] * 5
    ts = [Trial("fp16", "passkey", 512, i, 0.0, 500, score=x, **kw) for i, x in enumerate(scores)]
    ts += [Trial("same", "passkey", 512, i, 0.0, 500, score=x, **kw) for i, x in enumerate(scores)]
    flip = [0.0, *scores[1:]]  # prompt 0 lost
    ts += [Trial("flip", "passkey", 512, i, 0.0, 500, score=x, **kw) for i, x in enumerate(flip)]
    cells = {c.spec: c for c in aggregate(ts)}
    assert cells["same"].paired == 10 and cells["same"].paired_delta == 0.0
    assert cells["flip"].paired_delta == pytest.approx(-0.1)
    sd = math.sqrt((0.9**2 + 9 * 0.1**2) / 9)  # differences: one -1, nine 0
    assert cells["flip"].paired_sd == pytest.approx(sd)
    rows = {r["spec"]: r for r in summary(list(cells.values()))}
    assert rows["same"]["delta_half"] == 0.0
    assert rows["flip"]["delta_half"] == pytest.approx(1.96 * sd / math.sqrt(10))
    lo, hi = wilson(0.5, 10)
    assert hi - lo > 0.5  # what unpaired intervals would say
    # two cells: the mean of their differences, its variance the cells' over four
    two = [cells["flip"], cells["flip"]]
    assert paired_half(two) == pytest.approx(1.96 * math.sqrt(2 * sd**2 / 10) / 2)
    one = Trial("solo", "passkey", 512, 0, 0.0, 500, score=1.0, **kw)
    assert math.isnan(paired_half(aggregate([*ts[:10], one])[-1:]))  # one pair: no spread
    assert "| +- |" in report.markdown(list(cells.values()))


def test_a_spec_is_compared_with_fp16_on_the_prompts_both_finished(tmp_path):
    """A run stopped midway, or split by specs, finishes fewer prompts for some specs: their
    delta, interval and worst cell pair them with fp16's answers on those prompts alone (not
    fp16's whole cell), in the table ``velox eval`` prints and in ``--from-json``'s."""
    from velox_cli.longctx.report import summary

    kw = dict(kl=0.0, top1=1.0, bytes=100)
    fp16 = {512: [1.0, 1.0, 0.0, 0.0], 1024: [1.0, 0.0, 1.0, 0.0]}
    done = {512: 2, 1024: 4}  # "late" finished the first two prompts at 512 tokens
    ts = [
        Trial(spec, "passkey", n, i, 0.0, n, score=x, **kw)
        for spec, upto in (("fp16", {512: 4, 1024: 4}), ("late", done))
        for n, xs in fp16.items()
        for i, x in enumerate(xs[: upto[n]])
    ]
    # fp16 failed on prompt 3 at 1,024 tokens: that prompt pairs nothing
    ts[7] = Trial("fp16", "passkey", 1024, 3, 0.0, 1024, error="RuntimeError: x")
    rows = {r["spec"]: r for r in summary(aggregate(ts))}
    late = rows["late"]
    assert late["accuracy"] == {"passkey@512": 1.0, "passkey@1024": 0.5}  # its own prompts
    assert late["delta"] == 0.0 and late["worst_delta"] == 0.0 and late["delta_half"] == 0.0
    assert late["paired"] == 5 and late["pairs"] == [2, 3] and late["prompts"] == 6
    assert rows["fp16"]["pairs"] == [4, 3]
    # the whole cells would say +0.17: 1.0 against fp16's 0.5 at 512, 0.5 against 0.67
    whole = late["mean"] - rows["fp16"]["mean"]
    assert whole == pytest.approx((0.5 + 0.5 - 2 / 3) / 2)
    md = report.markdown(aggregate(ts))
    assert "| mean | delta | +- | worst | pairs |" in md
    assert "| `late` |" in md and "| +0.00 | 0.00 | +0.00 | 2-3 |" in md
    assert "on the prompts both finished" in md
    # the report of the saved run says the same
    path, out = tmp_path / "run.json", tmp_path / "run.md"
    report.write_json(str(path), ts, {"model": "m", "question": "after", "haystack": "prose"})
    assert main(["eval", "--from-json", str(path), "--chart", "", "--markdown", str(out)]) == 0
    assert out.read_text() == md
    # the table's title says when the policies cut; a run recorded before --cut names none
    info = {"model": "m", "question": "after", "haystack": "prose"}
    assert "question after | haystack" in report.table(aggregate(ts), info).title
    title = report.table(aggregate(ts), {**info, "cut": "once"}).title
    assert "question after, cut once | haystack" in title


def test_finished_prompts_need_every_spec():
    """A run split by specs reports each share's trials as it finishes them: a prompt counts
    as finished once every spec (and fp16) answered it."""
    from velox_cli.longctx.run import finished_prompts

    kw = dict(score=1.0, kl=0.0, top1=1.0)
    ts = [Trial(s, "passkey", 512, 0, 0.0, 500, **kw) for s in ("fp16", "a", "b")]
    ts += [Trial(s, "passkey", 512, 1, 0.0, 500, **kw) for s in ("fp16", "a")]
    assert finished_prompts(ts, ["a", "b"]) == 1
    assert finished_prompts(ts, ["fp16", "a"]) == 2
    assert finished_prompts(ts[3:], ["a"]) == 1


def test_layers_ratio_leaves_the_sliding_window_caches_out():
    # 400 of fp16's 1,000 bytes sit in the model's own sliding-window caches, held alike by
    # the spec: 1000/700 for the whole model, 600/300 over the layers the spec compresses
    kw = dict(score=1.0, kl=0.0, top1=1.0)
    ts = [
        Trial("fp16", "passkey", 512, 0, 0.0, 500, **kw, bytes=1000, window_bytes=400),
        Trial("a", "passkey", 512, 0, 0.0, 500, **kw, bytes=700, window_bytes=400),
    ]
    cell = {c.spec: c for c in aggregate(ts)}["a"]
    assert cell.ratio == pytest.approx(1000 / 700) and cell.layers_ratio == pytest.approx(2.0)
    md = report.markdown(aggregate(ts))
    assert "| vs fp16 | layers |" in md and "| 1.43x | 2.00x |" in md


def test_window_bytes_count_the_rotating_caches_alone():
    from velox_cli.longctx.run import window_bytes

    rot, full = RotatingKVCache(max_size=8), KVCache()
    for c in (rot, full):
        c.update_and_fetch(mx.ones((1, 1, 12, 4)), mx.ones((1, 1, 12, 4)))
    assert window_bytes([rot, full]) == held_bytes(rot) > 0
    assert window_bytes([full]) == 0


def test_settings_are_checked():
    with pytest.raises(ValueError, match="question"):
        EvalSettings(question="before").check()
    with pytest.raises(ValueError, match="lengths"):
        EvalSettings(lengths=[100]).check()
    with pytest.raises(ValueError, match="prompts"):
        EvalSettings(prompts=0).check()
    with pytest.raises(ValueError, match="split"):
        EvalSettings(split="tasks").check()
    with pytest.raises(ValueError, match="cut must be one of once, chunks"):
        EvalSettings(cut="never").check()


@pytest.mark.parametrize("mode", ["after", "inside"])
def test_cut_once_compresses_the_context_as_one_chunk_would(mode):
    """``cut="once"`` (kvpress's protocol): a context prefilled in chunks is cut once, at its
    end, so the caches keep what a one-chunk prefill keeps; ``cut="chunks"`` cuts each chunk as
    the next arrives, and keeps other tokens. Either way the question after it is held whole."""
    from velox_cli.longctx.tasks import Prompt
    from velox_testing import tiny_model

    model = tiny_model("llama", head_dim=64, hidden_size=128, vocab_size=512)
    rng = np.random.default_rng(0)
    context, question = rng.integers(1, 512, 192).tolist(), rng.integers(1, 512, 8).tolist()
    prompt = Prompt("passkey", 200, context, question, ["1"], 0.5, "noise", 4)

    def run(chunk: int, cut: str):
        caches = make_cache(model, "snapkv:budget=48")
        with routed(model):
            logits = prompt_caches(model, caches, prompt, mode, chunk, cut=cut)
            answer = mx.argmax(logits, axis=-1)[:, None]
            logits = model(answer, cache=caches)[:, -1]  # the answer's first token
        kept = [np.array(c.policy_view.body_positions()[0]) for c in caches]
        return np.array(logits.astype(mx.float32)), kept, [c.size() for c in caches]

    whole = run(256, "chunks")  # one chunk: one cut, whatever the setting
    once, chunks = run(64, "once"), run(64, "chunks")
    size = 48 + (len(question) if mode == "after" else 0) + 1  # and the answer's token
    assert whole[2] == once[2] == chunks[2] == [size] * len(whole[2])
    for a, b in zip(whole[1], once[1]):
        np.testing.assert_array_equal(a, b)
    np.testing.assert_allclose(once[0], whole[0], atol=2e-2)  # float16: chunks round apart
    assert any(not np.array_equal(a, b) for a, b in zip(whole[1], chunks[1]))


def test_eval_small_version_on_the_reference_model(tmp_path, capsys):
    """The suite's CI run: one short task, a few prompts, the reference model; fp16 is its
    own reference (KL 0, top-1 1), compressed caches hold fewer bytes, baselines included."""
    if find_shared("reference-model") is None:
        pytest.skip("the reference model (shared/reference-model) is not here")
    out, png, md = tmp_path / "eval.json", tmp_path / "eval.png", tmp_path / "eval.md"
    rc = main(
        [
            "eval",
            "--methods",
            "fp16",
            "uniform:bits=4",
            "uniform:bits=2",
            "mlx-q4",
            "--tasks",
            "passkey",
            "--lengths",
            "512",
            "--prompts",
            "2",
            "--jobs",
            "1",
            "--json",
            str(out),
            "--chart",
            str(png),
            "--markdown",
            str(md),
        ]
    )
    assert rc == 0
    data = json.loads(out.read_text())
    cells = {c["spec"]: c for c in data["cells"]}
    assert set(cells) == {"fp16", "uniform:bits=4", "uniform:bits=2", "mlx-q4"}
    assert all(c["prompts"] == 2 and c["errors"] == 0 for c in cells.values())
    assert cells["fp16"]["kl"] == 0.0 and cells["fp16"]["top1"] == 1.0
    assert cells["fp16"]["ratio"] == 1.0
    for spec in ("uniform:bits=4", "mlx-q4"):
        assert 2.5 < cells[spec]["ratio"] < 4.5, (spec, cells[spec]["ratio"])
        assert cells[spec]["kl"] >= 0.0
    assert cells["uniform:bits=2"]["ratio"] > cells["uniform:bits=4"]["ratio"]
    assert len(data["trials"]) == 8 and data["run"]["tasks"] == ["passkey"]
    assert png.stat().st_size > 10_000
    assert "`uniform:bits=4`" in md.read_text()
    printed = capsys.readouterr().out
    assert "velox eval" in printed and "uniform:bits=2" in printed
    # the report alone, from the JSON, and from the record kept as the run went
    assert main(["eval", "--from-json", str(out), "--chart", ""]) == 0
    record = str(out) + ".trials.jsonl"
    assert len(Path(record).read_text().splitlines()) == 8
    assert main(["eval", "--from-json", record, "--chart", ""]) == 0


def test_eval_rejects_bad_input_in_one_line(capsys):
    assert main(["eval", "--tasks", "needle", "--methods", "fp16"]) == 2
    assert "unknown task" in capsys.readouterr().err
    assert main(["eval", "--methods", "uniform:budget=150%"]) == 2
    assert "budget share" in capsys.readouterr().err


def test_sliding_layers_count_in_held_bytes(tmp_path):
    """A model's own rotating caches stay beside velox's and count in the bytes."""
    from velox_testing import tiny_model

    model = tiny_model("llama", head_dim=64, hidden_size=128, vocab_size=512)
    caches = make_cache(model, "uniform:bits=4")
    x = mx.array([[1, 2, 3, 4] * 40])
    model(x, cache=caches)
    assert sum(held_bytes(c) for c in caches) == sum(c.logical_nbytes for c in caches)


def test_chat_template_wraps_context_and_question(tok):
    """The user's turn holds context and question, the assistant's starts with the prefix."""
    tok.chat_template = (
        "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}<|end|>{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>{% endif %}"
    )
    try:
        (p,) = make_prompts(tok, "passkey", 1024, 1, template="chat")
    finally:
        tok.chat_template = None
    assert p.text.startswith("<|user|>There is an important")
    assert p.text.endswith("What is the pass key?<|end|><|assistant|>The pass key is")
    with pytest.raises(ValueError, match="chat template"):
        make_prompts(tok, "passkey", 1024, 1, template="chat")
    with pytest.raises(ValueError, match="unknown template"):
        make_prompts(tok, "passkey", 1024, 1, template="fancy")
