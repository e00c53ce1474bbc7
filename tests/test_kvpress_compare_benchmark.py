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


def _scores(keys: np.ndarray) -> np.ndarray:
    """KNorm's ``(H, n)`` scores (float32 negated norms) of ``keys (H, n, D)``."""
    return np.array(key_norm_scores(mx.array(keys)))


def _keeps_lowest(mask: np.ndarray, scores: np.ndarray, k: int, rtol: float = 0.0) -> bool:
    """Whether ``mask (H, n)`` keeps, in each head, ``k`` keys none of which has a larger norm
    than a key it drops, up to ``rtol`` of the norm. Keys that tie in float32 at the cut may
    go either way (which of them a top-k keeps depends on its order of work, not on the
    method); keys computed in other chunks differ in the last digits (BLAS blocks a 256-row
    product unlike a 1,024-row one), so near-ties at the cut may flip there."""
    for m, row in zip(mask, scores):
        cut = row[~m].max()
        if m.sum() != k or row[m].min() < cut - rtol * abs(cut):
            return False
    return True


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
    scores = np.stack([_scores(keys[i]) for i in glob])

    whole = cmp.prefill_chunk(0, [1024])
    kept, _ = cmp._velox_masks(model, mx.float32, prompt, spec, whole, tok)
    assert kept.shape == scores.shape
    assert all(_keeps_lowest(m, sc, budget) for m, sc in zip(kept, scores))

    # in chunks, a chunk attends to the kept part of the earlier ones in the first global
    # layer, and the layers above compute other keys: KNorm keeps other positions there
    chunked, _ = cmp._velox_masks(model, mx.float32, prompt, spec, 256, tok)
    assert _keeps_lowest(chunked[0], scores[0], budget, rtol=1e-5)
    assert not all(
        _keeps_lowest(m, sc, budget, rtol=1e-5) for m, sc in zip(chunked[1:], scores[1:])
    )


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
