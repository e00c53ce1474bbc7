"""The evaluation functions on tiny models: they measure what they claim."""

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import KVCache

from velox_cli.data import recall_prompts, token_stream
from velox_cli.evaluate import Row, decode_quality, prefill, reference_run, retrieval
from velox_cli.specs import Spec, StoredKVCache, build_caches, default_specs, parse
from velox_core import make_cache
from velox_testing import tiny_model, tiny_tokenizer

MODEL = tiny_model("llama")


def samples(n=2, ctx=96, cont=12, seed=0):
    rng = np.random.default_rng(seed)
    return [
        (rng.integers(0, 512, ctx).tolist(), rng.integers(0, 512, cont).tolist()) for _ in range(n)
    ]


def test_prefill_in_chunks_equals_one_pass():
    toks = samples(1, 200)[0][0]
    a = prefill(MODEL, [KVCache() for _ in MODEL.layers], toks, chunk=64)
    b = MODEL(mx.array([toks]), cache=[KVCache() for _ in MODEL.layers])[:, -1]
    assert mx.allclose(a.astype(mx.float32), b.astype(mx.float32), atol=2e-2).item()


def test_fp16_against_itself_has_zero_kl_and_full_agreement():
    s = samples()
    make = lambda: make_cache(MODEL, None)  # noqa: E731
    ref = reference_run(MODEL, make, s)
    row = Row("fp16", "fp16", {}, 96)
    decode_quality(MODEL, make, s, ref, row)
    assert row.kl == pytest.approx(0.0, abs=1e-6) and row.top1 == 1.0
    assert row.compression_ratio == pytest.approx(1.0)
    assert row.tokens == 96 + 12 - 1 and row.bytes_per_token > 0


def test_the_reference_run_fills_the_fp16_row_as_a_second_run_would():
    s = samples()
    make = lambda: make_cache(MODEL, None)  # noqa: E731
    own = Row("fp16", "fp16", {}, 96)
    ref = reference_run(MODEL, make, s, row=own)
    again = Row("fp16", "fp16", {}, 96)
    decode_quality(MODEL, make, s, ref, again)
    assert own.kl == 0.0 and own.top1 == 1.0 and own.compression_ratio == 1.0
    assert own.ppl == pytest.approx(again.ppl, rel=1e-6) and 1 < own.ppl < float("inf")
    for k in ("cache_bytes", "tokens", "bytes_per_token", "nonfinite_steps", "nonfinite_layers"):
        assert getattr(own, k) == getattr(again, k), k
    assert own.prefill_tps > 0 and own.decode_tps > 0 and own.prefill_peak_memory > 0
    assert ref.cache_bytes == own.cache_bytes and ref.tokens == own.tokens == 96 + 12 - 1


def test_jobs_follow_cores_backend_and_memory(monkeypatch):
    import velox_cli.bench as bench

    monkeypatch.setattr(bench, "backend", lambda: "cpu")
    monkeypatch.setattr(bench, "_usable_cpus", lambda: 4)
    monkeypatch.setattr(bench, "_available_memory", lambda: None)
    assert bench.auto_jobs(10) == 4 and bench.auto_jobs(3) == 3 and bench.auto_jobs(0) == 1
    # each job is counted at 4x the weights plus its own overhead
    per_job = 4 * 2**30 + bench.WORKER_OVERHEAD
    monkeypatch.setattr(bench, "_available_memory", lambda: 2 * per_job + 1)
    assert bench.auto_jobs(10, weight_bytes=2**30) == 2
    monkeypatch.setattr(bench, "_available_memory", lambda: 100)
    assert bench.auto_jobs(10, weight_bytes=2**30) == 1
    monkeypatch.setattr(bench, "_available_memory", lambda: None)
    monkeypatch.setattr(bench, "backend", lambda: "gpu")
    assert bench.auto_jobs(10) == 1
    with pytest.raises(ValueError, match="jobs"):
        bench.run_bench([], None, None, bench.BenchSettings(jobs=-2))


def test_kl_grows_as_bits_fall_and_bytes_are_measured():
    s = samples(3)
    ref = reference_run(MODEL, lambda: make_cache(MODEL, None), s)
    rows = {}
    for bits in (8, 4, 2):
        row = Row(f"uniform:bits={bits}", "uniform", {"bits": bits}, 96)
        decode_quality(MODEL, lambda b=bits: make_cache(MODEL, f"uniform:bits={b}"), s, ref, row)
        rows[bits] = row
    assert rows[8].kl < rows[4].kl < rows[2].kl
    assert rows[8].cache_bytes > rows[4].cache_bytes > rows[2].cache_bytes
    assert rows[4].compression_ratio > 2.5
    # perplexity is of the forced continuation: finite and positive
    assert all(0 < r.ppl < float("inf") for r in rows.values())


def test_retrieval_counts_exact_matches():
    tok = tiny_tokenizer()
    stream = token_stream(tok, ["x = 1\n" * 200])
    prompts = recall_prompts(tok, stream, [64, 128], [0.5], trials=2)
    assert len(prompts) == 4 and all(len(p.tokens) == p.length for p in prompts)
    assert prompts[0].correct(" 12345\n") is (prompts[0].value == "12345")
    acc, by_len = retrieval(MODEL, tok, lambda: make_cache(MODEL, None), prompts)
    assert 0.0 <= acc <= 1.0 and set(by_len) == {"64", "128"}


def test_recall_prompt_places_the_definition_at_its_depth():
    tok = tiny_tokenizer()
    stream = token_stream(tok, ["value = compute(a, b)\n" * 100])
    (p,) = recall_prompts(tok, stream, [200], [0.25], trials=1)
    text = tok.decode(p.tokens)
    assert f"= {p.value}\n" in text and text.rstrip().endswith("==")
    assert 0.15 < text.index(f"= {p.value}") / len(text) < 0.4


def test_specs_parse_and_validate():
    assert parse("fp16").baseline and parse("mlx-q4:group=32").params == {"group": 32}
    assert parse("uniform:bits=2,group=32").params == {"bits": 2, "group": 32}
    for bad in ("nope", "uniform:bitz=3", "uniform:bits=9", "mlx-q4:bits=3", "fp16:group=64"):
        with pytest.raises((ValueError, TypeError)):
            parse(bad)
    names = [s.text for s in default_specs()]
    assert names[:3] == ["fp16", "mlx-q4", "mlx-q8"] and "uniform:bits=4" in names


def test_storage_dtype_keeps_float16_bytes_for_a_float32_model():
    m32 = tiny_model("llama", dtype=mx.float32)
    toks = samples(1, 300)[0][0]
    # fp16 tokens take half of fp32; mlx-lm's 4-bit codes keep their size and their scales
    # halve; velox's Uniform keeps fp16 scales for fp32 inputs anyway
    for spec, ratio in (("fp16", 0.5), ("mlx-q4", 0.9), ("uniform:bits=4", 1.0)):
        stored = build_caches(parse(spec), m32, mx.float16)
        native = build_caches(parse(spec), m32, None)
        prefill(m32, stored, toks)
        prefill(m32, native, toks)
        got = sum(c.nbytes for c in stored) / sum(c.nbytes for c in native)
        assert got == pytest.approx(ratio, rel=1e-3), spec
    assert isinstance(build_caches(Spec("fp16", "fp16"), m32, mx.float16)[0], StoredKVCache)


def test_non_finite_logits_and_cache_entries_are_counted_and_shown():
    """A method whose codes decode to NaN does not look fine: the row counts the steps with
    non-finite log-probs and the layers whose cache holds NaN/inf, and the table prints NaN
    quality and those counts (a finite row prints 0)."""
    from velox_cli.report import COLUMNS, markdown
    from velox_core import Uniform, VeloxCache

    class NaNScales(Uniform):
        name = "nan-scales"

        def encode(self, x, positions=None):
            packed = super().encode(x, positions)
            packed.data["scale"] = packed.data["scale"] * float("nan")
            return packed

    def poisoned():  # layer 0's key codes carry NaN scales; 96 tokens pass one flush
        return make_cache(
            MODEL,
            lambda i: VeloxCache(
                key_codec=NaNScales(8) if i == 0 else Uniform(8), value_codec=Uniform(8)
            ),
        )

    s = samples()
    ref = reference_run(MODEL, lambda: make_cache(MODEL, None), s)
    bad = Row("nan", "velox", {}, 96)
    decode_quality(MODEL, poisoned, s, ref, bad)
    # layer 0 stores NaN scales; layer 1 then stores the NaN keys and values it is fed
    assert bad.nonfinite_steps == 2 * 12 and bad.nonfinite_layers == 2
    good = Row("uniform:bits=8", "uniform", {"bits": 8}, 96)
    decode_quality(MODEL, lambda: make_cache(MODEL, "uniform:bits=8"), s, ref, good)
    assert good.nonfinite_steps == good.nonfinite_layers == 0
    lines = markdown([bad, good]).splitlines()
    cells = [[c.strip() for c in line.strip("|").split("|")] for line in lines[2:]]
    col = {name: i for i, name in enumerate(COLUMNS)}
    assert cells[0][col["KL"]] == "NaN" and cells[0][col["non-finite"]] == "24 steps, 2 layers"
    assert cells[1][col["KL"]] != "NaN" and cells[1][col["non-finite"]] == "0"
    assert bad.to_json()["nonfinite_steps"] == 24
