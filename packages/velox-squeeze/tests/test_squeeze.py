"""SqueezeAttention: the conformance suite, the allocation, and the importance in a model."""

import itertools

import mlx.core as mx
import numpy as np
import pytest

import velox_testing.eviction as ev
from velox_core import VeloxCache, make_cache, routed
from velox_squeeze import (
    METHOD,
    SqueezeCache,
    SqueezePolicy,
    kmeans_1d,
    layer_budget,
    layer_budgets,
    places,
)
from velox_testing.refusals import named_refusals


class TestSqueeze(ev.FullBudgetConformance):
    """A budget above every length the suite stores: no layer evicts, whatever its place."""

    spec = "squeeze:budget=4096"
    bad_settings = (
        *ev.VOTE_BAD,  # SnapKV's rule inside each layer's budget
        *named_refusals(p=[-0.1, 1.5, float("nan"), "half"], base="h2o"),
        ({"base": "streamingllm", "observe": 8}, "observe"),
        ({"base": "streamingllm", "pooling": "max"}, "pooling"),
    )


class TestSqueezeEvicting(ev.Routed, ev.EvictingConformance):
    """A small budget, decode cuts and 4-bit codes: evicting, lossy, bounded (the suite's
    model has two layers: fewer than three groups, so each keeps the budget)."""

    spec = "squeeze:budget=64,observe=8,every=8,bits=4"
    precise_spec = "squeeze:budget=64,observe=8,every=8"


class TestSqueezeStreaming(ev.EvictingConformance):
    """StreamingLLM inside each layer's budget: no query is needed, so no routing."""

    spec = "squeeze:budget=64,base=streamingllm,sinks=4,every=8,bits=4"
    precise_spec = "squeeze:budget=64,base=streamingllm,sinks=4,every=8"


# -- the allocation ------------------------------------------------------------------------------
def _kmeans_reference(values, k=3):
    """Every partition of the sorted distinct values into k runs, the least squared error."""
    distinct = np.unique(values)
    best = None
    for cuts in itertools.combinations(range(1, len(distinct)), k - 1):
        bounds = [0, *cuts, len(distinct)]
        groups = np.searchsorted(distinct, values)
        label = np.zeros(len(values), dtype=int)
        for g in range(k):
            label[(groups >= bounds[g]) & (groups < bounds[g + 1])] = g
        sse = sum(((values[label == g] - values[label == g].mean()) ** 2).sum() for g in range(k))
        if best is None or sse < best[0] - 1e-15:
            best = (sse, label.tolist())
    return best[1]


def _sse(v, labels):
    lab = np.array(labels)
    return sum(((v[lab == g] - v[lab == g].mean()) ** 2).sum() for g in range(3))


def test_kmeans_1d_is_the_optimal_clustering():
    rng = np.random.default_rng(0)
    for trial in range(40):
        n = int(rng.integers(3, 12))
        v = rng.normal(0.9, 0.05, size=n)
        if trial % 4 == 0:
            v[: n // 2] = v[0]  # ties stay in one group
        got = kmeans_1d(v.tolist())
        ref = _kmeans_reference(v)
        assert abs(_sse(v, got) - _sse(v, ref)) < 1e-12, (v, got, ref)
        centers = [v[np.array(got) == g].mean() for g in range(3)]
        assert centers == sorted(centers)
    assert kmeans_1d([0.5, 0.5, 0.9]) is None  # two distinct values: no three groups


def test_the_most_similar_group_is_squeezed_and_the_budgets_sum_to_the_total():
    imp = [0.49, 0.91, 0.92, 0.93, 0.95, 0.94]  # the reference model's shape: layer 0 apart
    where = places(imp)
    assert [w.squeezed for w in where] == [False, False, False, True, True, True]
    budget, always, p = 100, 8, 0.4
    got = layer_budgets(budget, always, p, 1000, imp)
    # X = 92 selected on average: squeezed round(0.4 X) = 37, the others (6 X - 3 x 37) / 3
    assert got == [8 + 147] * 3 + [8 + 37] * 3
    assert sum(got) == 6 * budget
    rng = np.random.default_rng(1)
    for _ in range(300):
        n = int(rng.integers(1, 20))
        imp = rng.uniform(0.3, 1.0, size=n).tolist()
        always = int(rng.integers(0, 40))
        budget = always + int(rng.integers(1, 500))
        p = float(rng.uniform(0, 1))
        seen = int(rng.integers(0, 4 * budget))
        got = layer_budgets(budget, always, p, seen, imp)
        assert all(always <= g <= max(seen, always) for g in got), (got, seen)
        if seen > budget:
            assert sum(got) == n * budget, (got, budget, seen, p)
        else:
            assert got == [max(seen, always)] * n  # the prompt fits: nothing evicted
    assert layer_budget(100, 8, 0.4, 500, None) == 100  # undecided: uniform


def test_a_prompt_just_past_the_budget_fills_the_important_layers_first():
    imp = [0.2, 0.5, 0.9, 0.95]
    # the important layers' share (180 each) exceeds the 110 tokens: they keep them all,
    # and the squeezed layers share the rest of the 400
    assert [w.squeezed for w in places(imp)] == [False, False, True, True]
    assert layer_budgets(100, 0, 0.2, 110, imp) == [110, 110, 90, 90]


# -- the importance in a model -------------------------------------------------------------------
def _model(layers=6, family="llama", seed=0, dtype=mx.float32):
    from velox_testing import tiny_model

    return tiny_model(family, seed=seed, dtype=dtype, num_hidden_layers=layers)


def _reference_cosines(model, prompt, post_norm=False):
    """The mean cosine of each layer's attention input and output hidden states, computed by
    running the layers by hand (no velox) and taking the cosine in numpy (float64)."""
    from mlx_lm.models.base import create_attention_mask
    from mlx_lm.models.cache import KVCache

    inner = model.model
    h = inner.embed_tokens(prompt)
    if post_norm:  # Gemma 3 scales the embeddings
        h = h * mx.array(inner.args.hidden_size**0.5, mx.bfloat16).astype(h.dtype)
    out = []
    for layer in inner.layers:
        cache = KVCache()
        mask = create_attention_mask(h, cache)
        r = layer.self_attn(layer.input_layernorm(h), mask, cache)
        delta = layer.post_attention_layernorm(r) if post_norm else r
        x, y = np.array(h, dtype=np.float64), np.array(h + delta, dtype=np.float64)
        cos = (x * y).sum(-1) / (np.linalg.norm(x, axis=-1) * np.linalg.norm(y, axis=-1))
        out.append(cos.mean(axis=1))  # (B,)
        h = layer(h, mask, cache=KVCache())
    return np.stack(out, axis=1)  # (B, layers)


def _prefilled(cache, tokens: int, chunk: int, seed: int):
    """A 6-layer tiny llama with ``cache`` in every layer, after a random prompt of
    ``tokens`` tokens run routed in chunks of ``chunk``. Returns ``(model, prompt, caches)``."""
    model = _model()
    prompt = mx.random.randint(0, 512, (1, tokens), key=mx.random.key(seed))
    caches = make_cache(model, cache)
    with routed(model):
        for s in range(0, tokens, chunk):
            model(prompt[:, s : s + chunk], cache=caches)
    return model, prompt, caches


def test_importance_matches_a_numpy_reference_in_chunks():
    _, prompt, caches = _prefilled(SqueezeCache(budget=4096), 96, 32, seed=3)
    ref = _reference_cosines(_model(), prompt)[0]
    got = np.array([c.policy.row_importance()[0] for c in caches])
    np.testing.assert_allclose(got, ref, atol=2e-4)
    want = places(got.tolist())
    assert want is not None and [c.policy.place for c in caches] == want


def test_importance_of_gemma3_adds_the_post_attention_norm():
    """Gemma 3's residual adds ``post_attention_layernorm(r)``; its global layers hold the
    squeeze caches (the sliding ones keep their own), and only they are measured."""
    model, ref_model = _model(6, "gemma3"), _model(6, "gemma3")
    prompt = mx.random.randint(0, 512, (1, 40), key=mx.random.key(4))
    ref = _reference_cosines(ref_model, prompt, post_norm=True)[0]
    caches = make_cache(model, SqueezeCache(budget=4096))
    with routed(model):
        model(prompt, cache=caches)
    held = [i for i, c in enumerate(caches) if isinstance(c, SqueezeCache)]
    assert held and len(held) < 6
    got = [caches[i].policy.row_importance()[0] for i in held]
    np.testing.assert_allclose(got, ref[held], atol=2e-3)


def test_the_layers_keep_their_allocated_budgets_and_decode_stays_within_them():
    model, _, caches = _prefilled("squeeze:budget=48,observe=8,every=8", 300, 100, seed=5)
    with routed(model):
        imp = [c.policy.row_importance()[0] for c in caches]
        want = layer_budgets(48, 8, 0.4, 300, imp)
        model(mx.array([[1]]), cache=caches)  # the cut the last chunk owes
        assert [c.size() for c in caches] == [w + 1 for w in want]
        assert sum(want) == 6 * 48 and len(set(want)) > 1
        for t in range(60):
            model(mx.array([[t % 500]]), cache=caches)
            for c, w in zip(caches, layer_budgets(48, 8, 0.4, caches[0].offset, imp)):
                assert c.size() <= w + 8
    # float32 keys and values of 2 KV heads x 64 channels, the window's 16-token growth
    # quantum, and the observation window's 8 queries of 4 heads
    held = sum(w + 8 + 16 for w in layer_budgets(48, 8, 0.4, caches[0].offset, imp))
    assert sum(c.nbytes for c in caches) <= held * 2 * 2 * 64 * 4 + 6 * 8 * 4 * 64 * 4


def test_prompt_prefill_decides_once_from_the_whole_prompt():
    model, _, caches = _prefilled("squeeze:budget=40,observe=8,prefill=prompt", 200, 50, seed=6)
    assert all(c.size() == 200 for c in caches)  # held until the prompt's end
    with routed(model):
        model(mx.array([[3]]), cache=caches)
    imp = [c.policy.row_importance()[0] for c in caches]
    assert [c.size() for c in caches] == [w + 1 for w in layer_budgets(40, 8, 0.4, 200, imp)]


def test_save_load_and_copies_keep_the_allocation(tmp_path):
    import copy

    from velox_core import load_cache, save_cache

    spec = "squeeze:budget=40,observe=8,bits=4,group=32"
    model, _, caches = _prefilled(spec, 160, 64, seed=7)
    with routed(model):
        path = tmp_path / "c.safetensors"
        save_cache(path, caches)
        loaded = load_cache(path)
        twins = copy.deepcopy(caches)
        for other in (loaded, twins):
            assert [c.policy.place for c in other] == [c.policy.place for c in caches]
            assert [c.policy.row_importance() for c in other] == [
                c.policy.row_importance() for c in caches
            ]
        a = model(mx.array([[7]]), cache=caches)
        b = model(mx.array([[7]]), cache=loaded)
        c = model(mx.array([[7]]), cache=twins)
    assert mx.allclose(a, b, atol=1e-3).item() and mx.allclose(a, c, atol=1e-3).item()
    assert [x.size() for x in loaded] == [x.size() for x in caches]


def test_each_sequence_of_a_ragged_batch_is_decided_alone():
    """mlx-lm's batch_generate over prompts of different lengths, with budgets that bind:
    each row's tokens and allocation are those of its own single run."""
    from mlx_lm.generate import batch_generate, generate_step

    from velox_testing import tiny_tokenizer

    model = _model(dtype=mx.float16)
    prompts = [
        mx.random.randint(0, 512, (n,), key=mx.random.key(40 + n)).tolist() for n in (45, 18, 31)
    ]
    steps = [9, 4, 6]
    spec = "squeeze:budget=16,observe=4,every=4"
    with routed(model):
        singles, alloc = [], []
        for p, n in zip(prompts, steps):
            caches = make_cache(model, spec)
            gen = generate_step(
                mx.array(p), model, prompt_cache=caches, max_tokens=n, prefill_step_size=16
            )
            singles.append([int(t) for t, _ in gen])
            alloc.append([c.policy.place for c in caches])
        out = batch_generate(
            model,
            tiny_tokenizer(),
            prompts,
            max_tokens=steps,
            prompt_caches=[make_cache(model, spec) for _ in prompts],
            prefill_step_size=16,
            return_token_ids=True,
            return_prompt_caches=True,
        )
    assert out.token_ids == singles
    assert all(a is not None for row in alloc for a in row)
    got = [[c.policy.place for c in caches] for caches in out.caches]
    assert got == alloc
    assert len({tuple(a) for a in alloc}) > 1  # the sequences were placed differently


def test_rows_of_one_cache_share_the_allocation_of_their_mean():
    model = _model()
    prompt = mx.random.randint(0, 512, (2, 80), key=mx.random.key(8))
    caches = make_cache(model, "squeeze:budget=40,observe=8")
    with routed(model):
        model(prompt, cache=caches)
    rows = np.array([c.policy.row_importance() for c in caches])  # (layers, 2)
    assert rows.shape == (6, 2) and not np.allclose(rows[:, 0], rows[:, 1])
    assert [c.policy.place for c in caches] == places(rows.mean(axis=1).tolist())


def test_caches_placed_otherwise_are_not_batched_in_one_cache():
    model = _model()
    caches = []
    for seed in (9, 10):
        prompt = mx.random.randint(0, 512, (1, 60), key=mx.random.key(seed))
        c = make_cache(model, "squeeze:budget=4096")
        with routed(model):
            model(prompt, cache=c)
        caches.append(c)
    a, b = caches
    same = [i for i in range(6) if a[i].policy.place == b[i].policy.place]
    other = [i for i in range(6) if a[i].policy.place != b[i].policy.place]
    assert other, "the two prompts should place some layer differently"
    assert VeloxCache.merge([a[other[0]], b[other[0]]]).rows == [1, 1]
    if same:
        assert VeloxCache.merge([a[same[0]], b[same[0]]]).rows == [2]
    with pytest.raises(ValueError, match="same layer allocation"):
        a[other[0]].extend(b[other[0]])


def test_a_composed_cache_with_the_policy_is_observed_too():
    from velox_core import Uniform

    model = _model()
    template = VeloxCache(
        policy=SqueezePolicy(budget=40, observe=8),
        key_codec=Uniform(4, 32),
        value_codec=Uniform(4, 32),
    )
    caches = make_cache(model, template)
    with routed(model):
        model(mx.random.randint(0, 512, (1, 120), key=mx.random.key(11)), cache=caches)
    assert all(c.policy.place is not None for c in caches)


def test_the_observer_is_transparent_and_can_be_removed():
    """Installed, the model computes what it computed before (fp16 caches, decode too);
    uninstall gives the layers their own classes back; install is once per model."""
    from velox_squeeze import install, uninstall

    model = _model()
    prompt = mx.random.randint(0, 512, (1, 30), key=mx.random.key(12))
    classes = [type(m) for m in model.layers]
    before = model(prompt, cache=make_cache(model, None))
    obs = install(model)
    assert install(model) is obs
    assert type(model.layers[0]) is not classes[0] and isinstance(model.layers[0], classes[0])
    assert mx.array_equal(model(prompt, cache=make_cache(model, None)), before).item()
    assert dict(model.parameters()).keys() == dict(_model().parameters()).keys()
    uninstall(model)
    assert [type(m) for m in model.layers] == classes


def test_a_model_of_unknown_form_is_refused_at_make_cache():
    model = _model(3)
    model.model_type = "olmo"
    with pytest.raises(ValueError, match="supported model types: llama"):
        make_cache(model, "squeeze:budget=64")


def test_without_routing_snapkv_votes_refuse_the_cut_and_streamingllm_cuts():
    model = _model(3)
    prompt = mx.random.randint(0, 512, (1, 120), key=mx.random.key(13))
    caches = make_cache(model, "squeeze:budget=40,observe=8")
    model(prompt, cache=caches)
    with pytest.raises(ValueError, match="routed"):
        model(mx.array([[1]]), cache=caches)
    caches = make_cache(model, "squeeze:budget=40,base=streamingllm,sinks=4")
    model(prompt, cache=caches)
    model(mx.array([[1]]), cache=caches)
    assert all(c.size() <= 41 + 40 for c in caches) and caches[0].offset == 121


def test_registered_with_recommended_settings():
    assert METHOD.name == "squeeze" and SqueezePolicy in METHOD.policies
    for rec in METHOD.recommended:
        assert isinstance(SqueezeCache(**rec), SqueezeCache)


def test_a_cache_fed_without_the_observer_says_it_keeps_the_uniform_budget(monkeypatch):
    from velox_squeeze import policy as pol
    from velox_testing import feed, kv_data

    monkeypatch.setattr(pol, "_WARNED_UNMEASURED", [False])
    k, v = kv_data(t=200)
    c = SqueezeCache(budget=64, base="streamingllm", sinks=4)
    with pytest.warns(UserWarning, match="measured no layer importance"):
        feed(c, k, v, chunks=(100,))
    assert c.size() <= 64 + 100 and c.policy.place is None
