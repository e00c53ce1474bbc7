"""KVzip through velox's commands: ``velox generate`` and ``velox bench``'s samples run its
reconstruction step after the prefill (``velox eval``'s prompt path: test_longctx_methods)."""

import re

import numpy as np
import pytest

from velox_cli.data import find_shared

pytest.importorskip("velox_kvzip")
pytestmark = pytest.mark.skipif(
    find_shared("reference-model") is None, reason="the reference model is not here"
)


def test_generate_compresses_the_prompt(capsys):
    from velox_cli.main import main

    prompt = "def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n\n" * 10
    args = ["generate", "--method", "kvzip:budget=25%", "--prompt", prompt, "--max-tokens", "8"]
    assert main(args) == 0
    line = [x for x in capsys.readouterr().out.splitlines() if x.startswith("[velox]")][-1]
    ratio = float(re.search(r"\((\d+\.\d+)x[;)]", line).group(1))
    assert 3.0 < ratio < 4.5, line  # a quarter of the prompt, then the 8 generated tokens


def test_bench_sample_is_compressed_after_its_prefix():
    from velox_cli.bench import load_model
    from velox_cli.evaluate import Row, decode_quality, reference_run
    from velox_cli.specs import build_caches, parse

    model, tokenizer, store, _ = load_model(None)
    ids = np.random.default_rng(0).integers(100, 8000, 608).tolist()
    samples = [(ids[:600], ids[600:])]
    ref = reference_run(model, lambda: build_caches(parse("fp16"), model, store), samples)
    spec = parse("kvzip:budget=150")
    make = lambda: build_caches(spec, model, store)  # noqa: E731
    row = Row(spec.text, spec.name, spec.params, 600)
    decode_quality(model, make, samples, ref, row, 512, tokenizer)
    assert row.error is None and row.tokens == 607
    # 150 of the 600 prefix tokens per KV head (on average), then the 7 steps: about 4x
    assert 3.0 < row.compression_ratio < 5.0, row.compression_ratio  # resident bytes
    with pytest.raises(ValueError, match="tokenizer"):  # the step cannot run without it
        decode_quality(model, make, samples, ref, Row(spec.text, spec.name, {}, 600), 512)
