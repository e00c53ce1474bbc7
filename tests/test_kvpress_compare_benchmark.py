"""benchmarks/kvpress_compare.py's velox half (no torch) and benchmarks/gemma3_key_drift.py's
key taps, on a tiny random Gemma 3 (sliding window 16, every second layer global): velox
prefills each context in one chunk by default, as kvpress does, so KNorm keeps the
lowest-norm keys of one forward pass over the whole context in every compressed layer."""

import mlx.core as mx
import numpy as np
import pytest

from velox_cli.longctx.run import budget_tokens, resolve_spec
from velox_cli.longctx.tasks import make_prompts
from velox_knorm.policy import key_norm_scores
from velox_testing import tiny_model
from velox_testing.models import tiny_tokenizer


@pytest.fixture(scope="module")
def cmp(load_benchmark):
    return load_benchmark("kvpress_compare")


@pytest.fixture(scope="module")
def drift(load_benchmark):
    return load_benchmark("gemma3_key_drift")


def _parsed(cmp, monkeypatch, argv):
    seen = []
    monkeypatch.setattr(cmp, "_preload_blas", lambda: None)
    monkeypatch.setattr(cmp, "_compare", lambda a: seen.append(a) or 0)
    assert cmp.main(argv) == 0
    return seen[0]


def test_default_chunk_holds_the_longest_context(cmp, monkeypatch):
    assert _parsed(cmp, monkeypatch, ["--lengths", "2048", "4096"]).chunk == 4096
    assert _parsed(cmp, monkeypatch, ["--lengths", "4096", "--chunk", "512"]).chunk == 512
    with pytest.raises(SystemExit):
        _parsed(cmp, monkeypatch, ["--chunk", "-1"])


def _lowest(keys: np.ndarray, k: int) -> np.ndarray:
    """``(H, n)`` mask of the ``k`` lowest-norm keys of each head of ``keys (H, n, D)``
    (KNorm's float32 norms: two keys may differ below float64's resolution of them)."""
    scores = np.array(key_norm_scores(mx.array(keys)))
    m = np.zeros(scores.shape, dtype=bool)
    for h, row in enumerate(scores):
        m[h, np.argsort(-row)[:k]] = True
    return m


def test_knorm_keeps_the_lowest_norms_of_one_pass(cmp, drift):
    model = tiny_model("gemma3", dtype=mx.float32)
    # Gemma's k_norm scales each key to norm sqrt(D) times its weight (1 + w): at w = 0, as
    # initialized, every norm ties; a trained model's w spreads them
    mx.random.seed(1)
    for lay in model.layers:
        norm = lay.self_attn.k_norm
        norm.weight = 0.5 * mx.random.normal(norm.weight.shape)
    tok = tiny_tokenizer()
    (prompt,) = make_prompts(tok, "multikey:keys=2", 1024, 1, haystack="noise")
    n = len(prompt.context)
    spec = resolve_spec("knorm:budget=25%", budget_tokens(prompt, "after"))
    budget = int(spec.split("=")[1])
    glob = [i for i, lay in enumerate(model.layers) if not lay.self_attn.is_sliding]
    assert len(glob) >= 2 and glob[0] < n

    # the keys of one pass over the whole context (KNorm's caches cut after it)
    keys = drift._velox_keys(model, mx.float32, prompt.context, spec, n)
    expected = np.stack([_lowest(keys[i], budget) for i in glob])

    whole = cmp.prefill_chunk(0, [1024])
    kept, _ = cmp._velox_masks(model, mx.float32, prompt, spec, whole, tok)
    assert kept.shape == expected.shape
    assert np.array_equal(kept, expected)

    # in chunks, a chunk attends to the kept part of the earlier ones in the first global
    # layer, and the layers above compute other keys: KNorm keeps other positions there
    chunked, _ = cmp._velox_masks(model, mx.float32, prompt, spec, 256, tok)
    assert np.array_equal(chunked[0], expected[0])
    assert not np.array_equal(chunked[1:], expected[1:])


def test_layer_stats(drift):
    rng = np.random.default_rng(0)
    hf = rng.standard_normal((64, 8)).astype(np.float32)
    same = drift.layer_stats(hf, hf, hf, 16)
    assert same["jaccard_lowest"] == 1.0 and same["norm_max_rel_diff"] == 0.0
    assert same["norm_spearman"] == pytest.approx(1.0)
    scaled = drift.layer_stats(hf * 1.1, hf * 1.1, hf, 16)  # a common scale keeps the order
    assert scaled["norm_max_rel_diff"] == pytest.approx(0.1, rel=1e-5)
    assert scaled["jaccard_lowest"] == 1.0
    flipped = drift.layer_stats(hf[::-1], hf[::-1], hf, 16)
    assert flipped["jaccard_lowest"] < 1.0
