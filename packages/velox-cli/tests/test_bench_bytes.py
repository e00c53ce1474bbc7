"""One byte convention for every row of ``velox bench`` and for ``velox generate``: the bytes
of the tokens a cache holds (every array's rows holding tokens, a velox cache's fitted state),
fp16 and mlx-lm's caches counted alike, checked against bytes computed by hand from the
layouts (not from the caches' own counters)."""

import json
import math
import re

import pytest

from velox_cli.main import main

# the tiny model of conftest.model_dir: 2 layers, 2 KV heads, head dim 64, float16 storage
LAYERS, HEADS, D = 2, 2, 64


def _per_token_head(spec: str) -> int:
    """Bytes one token of one KV head takes on one side (keys or values), by hand."""
    if spec == "fp16":
        return D * 2
    if spec in ("mlx-q4", "uniform:bits=4,flush=1"):
        # 4-bit codes packed in uint32 words, an fp16 scale and bias (zero) per 64 channels
        return D * 4 // 8 + (D // 64) * 2 * 2
    if spec == "turboquant:bits=3,flush=1":
        return math.ceil(D * 3 / 32) * 4 + 2  # 3-bit codes in uint32 words, an fp16 norm
    if spec == "polarquant:bits=4,flush=1":
        # 4 polar levels of a 64-dim vector: 32 angles at 4 bits, 16, 8 and 4 at 2 bits (one
        # byte stream a level), and the 4 fp16 radii of its 16-dim blocks
        return 32 * 4 // 8 + 16 * 2 // 8 + 8 * 2 // 8 + 4 * 2 // 8 + (D // 16) * 2
    raise KeyError(spec)


def _state(spec: str) -> int:
    """Bytes a layer's fitted codec state takes (two codecs: keys and values)."""
    if spec.startswith("turboquant"):
        return 2 * (D * 4 + 8 * 4 + 7 * 4)  # float32 rotation signs, 8 levels, 7 bounds
    if spec.startswith("polarquant"):
        return 2 * (D * 4 + (16 + 4 + 4 + 4) * 4)  # signs, the four levels' codebooks
    return 0


def held(spec: str, tokens: int) -> int:
    return LAYERS * (2 * HEADS * tokens * _per_token_head(spec) + _state(spec))


def _needs(*modules: str) -> None:
    """Skip where a method package the test runs is not installed (velox-cli's nox session
    installs them: noxfile.TEST_WITH)."""
    for name in modules:
        pytest.importorskip(name, reason=f"runs {name} (pip install {name.replace('_', '-')})")


SPECS = [
    "fp16",
    "mlx-q4",
    "uniform:bits=4,flush=1",
    "turboquant:bits=3,flush=1",
    "polarquant:bits=4,flush=1",
]


def test_bench_prints_fp16_held_bytes_over_each_rows(model_dir, text_file, tmp_path, capsys):
    _needs("velox_turboquant", "velox_polarquant")
    out = tmp_path / "rows.json"
    argv = ["bench", "--model", model_dir, "--data", text_file, "--context", "96"]
    argv += ["--continuation", "8", "--chunk", "32", "--jobs", "1", "--methods", *SPECS]
    assert main([*argv, "--json", str(out), "--chart", ""]) == 0
    printed = capsys.readouterr().out
    tokens = 96 + 8 - 1  # the prefix and the teacher-forced continuation but its last token
    rows = {r["spec"]: r for r in json.loads(out.read_text())}
    fp16 = held("fp16", tokens)
    for spec in SPECS:
        r = rows[spec]
        assert r["tokens"] == tokens and r["cache_bytes"] == held(spec, tokens), spec
        assert r["compression_ratio"] == pytest.approx(fp16 / held(spec, tokens), rel=1e-12)
        # mlx-lm allocates 256 slots at a time: its resident bytes count them, held bytes not
        assert r["resident_bytes"] >= r["cache_bytes"]
        row = re.compile(rf"^\s*\*?\d+\s+{re.escape(spec)}\s")
        line = next(x for x in printed.splitlines() if row.search(x))
        ratio = next(
            c for c in line.split() if c.endswith("x") and c[:-1].replace(".", "").isdigit()
        )
        assert ratio == f"{fp16 / held(spec, tokens):.2f}x", (spec, line)
    assert rows["fp16"]["resident_bytes"] == LAYERS * 2 * HEADS * 256 * D * 2
    assert "held bytes: the bytes of the tokens a cache holds" in printed


def test_generate_ratio_is_one_for_fp16_and_says_what_waits_in_fp16(model_dir, capsys):
    def run(spec: str) -> str:
        argv = ["generate", "--model", model_dir, "--method", spec, "--max-tokens", "20"]
        assert main([*argv, "--prompt", "def add(a, b):"]) == 0
        return capsys.readouterr().out

    out = run("fp16")
    assert "(1.00x;" in out, out  # fp16 against itself, on the same tokens
    out = run("uniform:bits=4")  # the default 64-token flush: every token still waits
    assert "[velox] " in out and "wait in fp16" in out and "flush=64" in out, out
    m = re.search(r"\[velox\] (\d+) of the (\d+) tokens each layer holds wait in fp16", out)
    assert m and m.group(1) == m.group(2), out


def test_bench_defaults_to_the_quick_subset_and_skips_a_method_without_its_file(
    model_dir, text_file, tmp_path, capsys
):
    """No --methods: the quick subset (--all: every method); a method whose fitted file is
    missing for the model is skipped with one line naming its fit command, not measured."""
    from velox_cli.specs import QUICK

    _needs("velox_kivi", "velox_turboquant", "velox_polarquant", "velox_snapkv", "velox_palu")
    out = tmp_path / "rows.json"
    argv = ["bench", "--model", model_dir, "--data", text_file, "--quick", "--context", "64"]
    argv += ["--jobs", "1", "--chart", "", "--json", str(out)]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert "the quick subset; --all measures all" in printed.replace("\n", " ")
    assert [r["spec"] for r in json.loads(out.read_text())] == list(QUICK)
    assert main([*argv, "--methods", "fp16", "palu:ratio=0.5"]) == 0
    printed = capsys.readouterr().out.replace("\n", "")
    assert (
        "skipped palu:ratio=0.5: no fitted file for this model; fit one with python -m "
        "velox_palu fit" in printed
    )
    rows = json.loads(out.read_text())
    assert [r["spec"] for r in rows] == ["fp16"]
    assert rows[0]["run"]["skipped"][0]["spec"] == "palu:ratio=0.5"
    assert main([*argv, "--all", "--methods", "fp16"]) == 2
