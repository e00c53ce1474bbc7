"""KVzip: the conformance suite, and the reconstruction step against a brute-force reference
(``kvzip_reference``: the authors' scoring in numpy on mlx-lm's own cache)."""

import copy
import warnings

import mlx.core as mx
import numpy as np
import pytest
from kvzip_reference import Recorder, gemma3_reference, reference_scores
from mlx_lm.models.cache import KVCache

import velox_kvzip
import velox_testing.eviction as ev
from velox_core import load_cache, make, make_cache, routed, save_cache
from velox_kvzip import METHOD, KVzipCache, KVzipConfig, KVzipPolicy, compress
from velox_testing import tiny_model, tiny_tokenizer

N = 300  # context tokens
MODEL = tiny_model("llama", dtype=mx.float32)  # 2 layers, 4 query heads, 2 KV heads
TOK = tiny_tokenizer()
CONTEXT = mx.random.randint(0, 400, (N,), key=mx.random.key(0)).tolist()


class TestKVzip(ev.Routed, ev.FullBudgetConformance):
    """Before compress a KVzip cache keeps every token (the suite fills caches without a
    model, so it never compresses): the full-budget bounds hold at any budget."""

    max_memory_ratio = 1.01  # fp16 tokens and the body's int32 positions
    bad_settings = (
        ({"heads": "adaptive"}, "heads"),
        ({"chunk": 0}, "chunk"),
        ({"chunk": 1.5}, "chunk"),
        ({"overlap": -1}, "overlap"),
        ({"prompt": ""}, "prompt"),
        ({"prompt": 3}, "prompt"),
        ({"prompt_next": None}, "prompt_next"),
        ({"suffix": b"\n"}, "suffix"),
        ({"budget": "0%"}, "budget"),
        ({"budget": "150%"}, "budget"),
        ({"budget": "a quarter"}, "budget"),
        ({"budget": 0.25}, "budget"),
        ({"budget": "25%", "every": 0}, "every"),
        ({"every": 1}, "every"),  # KVzip cuts once, in compress
        {"compression_ratio": 0.75},  # kvpress's name: velox counts tokens (budget)
        {"layerwise": True},  # kvpress's name: heads='layer'
        {"n_sink": 4},  # kvpress's name: sinks
    )

    def make(self):
        return KVzipCache(budget=4096)


def run(spec, start=0, step=512):
    caches = make_cache(MODEL, spec)
    with routed(MODEL):
        MODEL(mx.array([CONTEXT]), cache=caches)
        r = compress(MODEL, caches, CONTEXT, TOK, start=start, step=step)
    return caches, r


def kept_masks(caches):
    """Per layer, ``(H, n)`` bool: the context positions each KV head holds."""
    out = []
    for c in caches:
        m = np.zeros((c.kv_heads, N), dtype=bool)
        m[:, : c.policy_view.sink_count()] = True
        for h, pos in enumerate(c.policy_view.body_positions()):
            pos = np.array(pos[0])
            m[h, pos[pos < N]] = True
        out.append(m)
    return out


# -- scores, budgets, roll-back -----------------------------------------------------------------
@pytest.mark.parametrize(
    ("chunk", "sinks", "start", "step"),
    [(512, 4, 0, 512), (512, 4, 0, 50), (128, 4, 0, 512), (128, 4, 0, 37), (100, 6, 10, 512)],
)
def test_scores_equal_the_brute_force_reference(chunk, sinks, start, step):
    """One chunk (softmax over every stored key), three chunks (sinks, the chunk, the
    reconstruction tokens), a kept prefix, and the input fed in pieces of ``step``: the max
    over queries and the group's heads."""
    ref = reference_scores(MODEL, TOK, CONTEXT, chunk, sinks, start)
    _, r = run(f"kvzip:budget=64,sinks={sinks},chunk={chunk}", start, step)
    assert r.chunks == -(-(N - start) // chunk) and r.context == N - start
    for got, want in zip(r.scores, ref):
        got = np.array(got[0])
        assert np.array_equal(np.isinf(got), np.isinf(want))
        fin = np.isfinite(want)
        assert np.allclose(got[fin], want[fin], rtol=1e-4, atol=1e-6)
    # the rule is a max, not a mean: a mean over the queries scores otherwise
    assert max(float(np.max(want[np.isfinite(want)])) for want in ref) > 0.2


@pytest.mark.parametrize("heads", ["global", "layer", "uniform"])
def test_budget_and_kept_pairs(heads):
    """Each mode keeps exactly its budget (sinks + best body pairs of its ranking)."""
    ref = reference_scores(MODEL, TOK, CONTEXT, 128, 4)
    caches, r = run(f"kvzip:budget=25%,heads={heads},chunk=128")
    kept = kept_masks(caches)
    budget, hh = round(0.25 * N), 2
    body = [s[:, 4:] for s in ref]  # the sinks are protected, the rest ranked
    if heads == "uniform":
        want = [np.argsort(-b, axis=1)[:, : budget - 4] for b in body]
        for m, w in zip(kept, want):
            assert all(set(np.flatnonzero(m[h, 4:])) == set(w[h]) for h in range(hh))
    else:
        pools = [b.reshape(-1) for b in body]
        pools = pools if heads == "layer" else [np.concatenate(pools)]
        quota = (budget - 4) * hh * (1 if heads == "layer" else len(body))
        thresholds = [np.sort(p)[-quota] for p in pools]
        for i, m in enumerate(kept):
            t = thresholds[i if heads == "layer" else 0]
            assert np.array_equal(m[:, 4:], body[i] >= t)
    total = sum(int(m.sum()) for m in kept)
    assert total == budget * hh * len(kept)
    assert r.kept == pytest.approx([m.sum() / hh for m in kept])
    if heads == "global":  # the paper's point: budgets move between heads and layers
        assert len({int(x) for m in kept for x in m.sum(axis=1)}) > 1


@pytest.mark.parametrize("heads", ["global", "uniform"])
def test_rollback_and_decoding(heads):
    """After compress the caches hold the prefill's tokens only (offset n, the next token at
    position n): three decode steps give the logits of fp32 attention over the kept context."""
    caches, _ = run(f"kvzip:budget=25%,heads={heads},chunk=128")
    assert all(c.offset == N for c in caches)
    steps = [[7], [11], [13]]
    with routed(MODEL):
        got = [MODEL(mx.array([s]), cache=caches)[0, -1] for s in steps]
    ref_caches = [KVCache() for _ in MODEL.layers]
    MODEL(mx.array([CONTEXT]), cache=ref_caches)
    with Recorder(len(MODEL.layers), N, kept_masks(caches)).patched():
        want = [MODEL(mx.array([s]), cache=ref_caches)[0, -1] for s in steps]
    for a, b in zip(got, want):
        assert np.allclose(np.array(a), np.array(b), atol=2e-3)
    assert all(c.offset == N + 3 for c in caches)
    # an offset off by one (a reconstruction token left behind) changes the logits
    bad, _ = run(f"kvzip:budget=25%,heads={heads},chunk=128")
    with routed(MODEL):
        for c in bad:
            c.offset += 1
        off = MODEL(mx.array([steps[0]]), cache=bad)[0, -1]
    assert not np.allclose(np.array(off), np.array(want[0]), atol=2e-3)


# -- state, misuse, settings ---------------------------------------------------------------------
def test_compressed_cache_saves_loads_and_copies(tmp_path):
    """Per-head budgets (global) survive a file and a deep copy; both stay compressed."""
    caches, _ = run("kvzip:budget=20%,chunk=128")
    assert any(c.ragged for c in caches)
    save_cache(tmp_path / "c.safetensors", caches)
    loaded = load_cache(tmp_path / "c.safetensors")
    twin = copy.deepcopy(caches)
    with routed(MODEL):
        logits = [MODEL(mx.array([[7]]), cache=cs)[0, -1] for cs in (caches, loaded, twin)]
    assert all(np.allclose(np.array(logits[0]), np.array(x), atol=1e-4) for x in logits[1:])
    assert all(c.policy.compressed and c.policy.budget == 60 for c in loaded)
    with pytest.raises(ValueError, match="compressed already"):
        compress(MODEL, loaded, [*CONTEXT, 7], TOK)


def test_compress_refuses_what_it_cannot_do():
    def prefilled(spec, tokens=CONTEXT, **kw):
        caches = make_cache(MODEL, spec, **kw)
        with routed(MODEL):
            MODEL(mx.array([tokens] if isinstance(tokens[0], int) else tokens), cache=caches)
        return caches

    caches = prefilled("kvzip:budget=64")
    with pytest.raises(ValueError, match="holds 300 tokens, tokens gives 299"):
        compress(MODEL, caches, CONTEXT[:-1], TOK)
    with pytest.raises(ValueError, match="tokenizer"):
        compress(MODEL, caches, CONTEXT, None)
    with pytest.raises(ValueError, match="start"):
        compress(MODEL, caches, CONTEXT, TOK, start=N)
    with pytest.raises(ValueError, match="step"):
        compress(MODEL, caches, CONTEXT, TOK, step=0)
    with pytest.raises(ValueError, match="token ids"):
        compress(MODEL, caches, [[[1]]], TOK)
    with pytest.raises(ValueError, match="no kvzip cache"):
        compress(MODEL, prefilled("uniform:bits=8"), CONTEXT, TOK)
    mixed = prefilled("kvzip:budget=64", layers={0: "kvzip:budget=64,chunk=99"})
    with pytest.raises(ValueError, match="chunk settings differ"):
        compress(MODEL, mixed, CONTEXT, TOK)
    rows = np.array([CONTEXT, CONTEXT[::-1]])
    with pytest.raises(ValueError, match="heads='uniform'"):
        compress(MODEL, prefilled("kvzip:budget=64", rows.tolist()), rows, TOK)
    assert all(c.offset == N and c.size() == N for c in caches)  # nothing was touched


@pytest.mark.parametrize("other", ["rotating", "uniform:bits=4"])
def test_layers_that_cannot_trim_are_restored(other):
    """A layer whose cache cannot be trimmed (mlx-lm's RotatingKVCache past its window, as
    Gemma 3's sliding layers; a velox quantized cache) sees each chunk's reconstruction and
    is restored after it: it ends holding what the prefill left, and the KVzip layers are
    scored as when every chunk starts from the prefilled caches."""
    from mlx_lm.models.cache import RotatingKVCache

    # a rotating cache goes last (the model's one mask comes from the first layer's cache);
    # the quantized one first, so that the KVzip layer after it attends through it
    at = 1 if other == "rotating" else 0

    def prefilled():
        caches = make_cache(MODEL, "kvzip:budget=64,chunk=128")  # three chunks of the 300
        caches[at] = RotatingKVCache(max_size=64) if other == "rotating" else make(other)
        with routed(MODEL):
            MODEL(mx.array([CONTEXT]), cache=caches)
        return caches

    caches = prefilled()
    assert not caches[at].is_trimmable()
    before = [np.array(a) for a in caches[at].state]
    report = compress(MODEL, caches, CONTEXT, TOK)
    assert report.chunks == 3 and caches[at].offset == N
    for a, b in zip(before, caches[at].state):
        np.testing.assert_array_equal(a, np.array(b))
    # each chunk's input (compress's own) run alone over freshly prefilled caches gives the
    # same scores: no chunk saw what an earlier one left in the untrimmable layer
    for s, e in [(0, 128), (128, 256), (256, 300)]:
        fresh = prefilled()
        zipped = [(c, c.policy) for c in fresh if c is not fresh[at]]
        scores = _one_chunk(fresh, zipped, s, e)
        for got, want in zip(report.scores, scores, strict=True):
            np.testing.assert_allclose(np.array(got[..., s:e]), np.array(want), rtol=1e-5)
    with routed(MODEL):  # the model goes on from the compressed caches
        mx.eval(MODEL(mx.array([[7]]), cache=caches))
    assert caches[at].offset == N + 1


def test_gemma3_global_layers_score_their_own_attention():
    """Gemma 3: velox compresses the global layers, the sliding-window ones keep mlx-lm's
    RotatingKVCache (restored after each chunk). Each global layer's scores are the attention
    its reconstruction queries give the context, as computed from the layer's input alone
    (projections, query and key norms, RoPE at absolute positions, ``query_pre_attn_scalar``
    other than the head dim), on every chunk."""
    model = tiny_model("gemma3", dtype=mx.float32, query_pre_attn_scalar=48)
    caches = make_cache(model, "kvzip:budget=25%,chunk=128")  # three chunks of the 300
    zipped = [i for i, c in enumerate(caches) if isinstance(c, KVzipCache)]
    assert zipped == [1, 3]  # sliding_window_pattern 2: every second layer is global
    with routed(model):
        model(mx.array([CONTEXT]), cache=caches)
        r = compress(model, caches, CONTEXT, TOK)
    assert r.chunks == 3
    want = gemma3_reference(model, TOK, CONTEXT, 128, 4, zipped)
    for got, ref in zip(r.scores, want, strict=True):
        np.testing.assert_allclose(np.array(got[0]), ref, rtol=2e-3, atol=1e-5)
    assert max(float(ref.max()) for ref in want) > 0.2


def _one_chunk(caches, zipped, s, e):
    """The scores of one reconstruction chunk ``[s, e)`` run alone over prefilled caches,
    with compress's own input for it."""
    from velox_kvzip.compress import _repeat_inputs

    policy = zipped[0][1]
    pieces = {a: x for a, _, x in _repeat_inputs(TOK, policy, np.array([CONTEXT]), 0)}
    for c, p in zipped:
        p.begin(min(c.sinks, s), s, e, N)
    with routed(MODEL):
        MODEL.model(mx.array(pieces[s]), cache=caches)
    return [p.take() for _, p in zipped]


def test_batch_rows_keep_what_each_keeps_alone():
    rows = np.array([CONTEXT, CONTEXT[::-1]])
    spec = "kvzip:budget=25%,heads=uniform,chunk=128"
    batch = make_cache(MODEL, spec)
    with routed(MODEL):
        MODEL(mx.array(rows), cache=batch)
        compress(MODEL, batch, rows, TOK)
    for i in range(2):
        caches = make_cache(MODEL, spec)
        with routed(MODEL):
            MODEL(mx.array(rows[i : i + 1]), cache=caches)
            compress(MODEL, caches, rows[i], TOK)
        for a, b in zip(batch, caches):
            pa, pb = (np.array(mx.stack(c.policy_view.body_positions(), axis=1)) for c in (a, b))
            assert np.array_equal(pa[i], pb[0])


def test_coded_kept_tokens_and_a_prefix():
    """``bits=4``: the reconstruction scores the coded keys and the kept pairs stay coded; the
    prefix before ``start`` is kept whole."""
    caches, r = run("kvzip:budget=40%,bits=4,group=32,chunk=128,heads=uniform", start=40)
    assert all(c.offset == N and c.size() == 120 for c in caches)
    assert all(np.isinf(np.array(s[0, :, :40])).all() for s in r.scores)
    assert all(set(range(40)) <= set(np.flatnonzero(m[0])) for m in kept_masks(caches))
    assert caches[0].tiers[0].key_codec.describe().startswith("uniform")


def test_decoding_uncompressed_warns_once(monkeypatch):
    monkeypatch.setattr(velox_kvzip.policy, "_WARNED", set())
    caches = make_cache(MODEL, "kvzip:budget=64")
    with routed(MODEL), warnings.catch_warnings(record=True) as got:
        warnings.simplefilter("always")
        MODEL(mx.array([CONTEXT[:100]]), cache=caches)
        MODEL(mx.array([[1]]), cache=caches)
        MODEL(mx.array([[2]]), cache=caches)
    assert [str(w.message).split(":")[0] for w in got] == ["kvzip"]
    assert caches[0].size() == 102  # nothing is cut without compress


def test_settings_registration_and_split():
    assert METHOD.name == "kvzip" and KVzipPolicy in METHOD.policies
    c = make("kvzip:budget=25%,heads=layer,chunk=512")
    assert c.policy.share == 0.25 and c.policy.budget is None and c.policy.heads == "layer"
    assert c.policy.kept(2000) == 500 and KVzipConfig(budget=300).budget == 300
    assert type(c.policy).from_config(c.policy.config()).config() == c.policy.config()
    assert "prompt" not in c.policy.describe()
    refusal = KVzipCache.split_refusal
    assert "every layer" in refusal({"heads": "global"}, True, False)
    assert "a layer" in refusal({"heads": "layer"}, True, False)
    assert refusal({"heads": "uniform"}, True, False) == ""
    assert "stages" in refusal({"heads": "global"}, False, True)
    assert refusal({"heads": "layer"}, False, True) == ""
