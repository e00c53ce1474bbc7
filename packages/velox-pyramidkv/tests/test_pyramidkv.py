"""PyramidKV: the conformance suite, the pyramid, and SnapKV's rule inside each layer."""

import itertools
import json
import math

import mlx.core as mx
import numpy as np
import pytest

import velox_testing.eviction as ev
import velox_testing.references as refs
from velox_core import load_cache, make_cache, routed, save_cache
from velox_core.io import _digest
from velox_pyramidkv import (
    METHOD,
    PyramidKVCache,
    PyramidKVPolicy,
    layer_budget,
    layer_budgets,
)
from velox_testing import kv_data, rel_error, tiny_model
from velox_testing.eviction import kept_positions as kept
from velox_testing.refusals import named_refusals

D = 64
SCALE = D**-0.5


class TestPyramidKV(ev.FullBudgetConformance):
    """A budget above every length the suite stores: no layer evicts, whatever its place (a
    cache made without a model needs no place until the prompt exceeds the budget)."""

    spec = "pyramidkv:budget=4096"
    bad_settings = (
        *ev.VOTE_BAD,
        *named_refusals(beta=[0.5, float("nan"), float("inf"), "steep"]),
        ({"layer": 1}, "n_layers"),  # a place needs both
        ({"n_layers": 4}, "layer"),
        ({"layer": 4, "n_layers": 4}, "layer"),
        ({"layer": -1, "n_layers": 4}, "layer"),
        ({"layer": 0, "n_layers": 0}, "n_layers"),
    )


class TestPyramidKVEvicting(ev.Routed, ev.EvictingConformance):
    """A small budget, decode cuts and 4-bit codes: evicting, lossy, bounded. Made without
    a model the cache is given its place (the deeper of two layers: the smaller budget);
    make_cache places the suite's model-level caches itself."""

    spec = "pyramidkv:budget=64,observe=8,every=8,bits=4,layer=1,n_layers=2"
    precise_spec = "pyramidkv:budget=64,observe=8,every=8"


# -- helpers ---------------------------------------------------------------------------------
def kvpress_layer_budget(q_len, window, ratio, beta, layer, n_layers):
    """kvpress 0.5.5's PyramidKVPress.get_layer_budget, transcribed (floats); None where it
    falls back to a uniform budget."""
    mcp = window + q_len * (1 - ratio)
    lo = (mcp - window) / beta
    hi = (mcp - window) * 2 - lo
    if hi >= q_len - window:
        hi = q_len - window
        lo = (mcp - window) * 2 - hi
    if not q_len >= hi >= lo >= window:
        return None
    steps = (hi - lo) / (n_layers - 1)
    return round(hi - layer * steps)


# -- the pyramid -------------------------------------------------------------------------------
def test_the_pyramid_by_hand():
    """budget 512 with 32 tokens always kept: each layer selects from X = 480 on average; the
    top layer X / 20 = 24, the bottom 2 X - 24 = 936, linear in between (step 304)."""
    assert layer_budgets(512, 32, 4, 20, 4096) == [32 + 936, 32 + 632, 32 + 328, 32 + 24]
    # 800 tokens seen: 768 candidates, fewer than the bottom layer's 936: it keeps them all
    # and the top layer 2 X - 768 = 192 (step 192)
    assert layer_budgets(512, 32, 4, 20, 800) == [32 + 768, 32 + 576, 32 + 384, 32 + 192]
    # X = 84: 163.8, 110.6, 57.4, 4.2 rounded
    assert layer_budgets(100, 16, 4, 20, 4096) == [16 + 164, 16 + 111, 16 + 57, 16 + 4]
    assert layer_budgets(100, 16, 3, 20, 4096) == [16 + 164, 16 + 84, 16 + 4]
    # the prompt within the average budget: nothing to evict in any layer
    assert layer_budgets(512, 32, 4, 20, 300) == [300] * 4
    assert layer_budgets(512, 32, 4, 20, 512) == [512] * 4
    assert layer_budgets(512, 32, 1, 20, 4096) == [512]  # one layer: the budget
    assert layer_budgets(512, 32, 5, 1, 4096) == [512] * 5  # beta 1: uniform (SnapKV)


@pytest.mark.parametrize("n_layers", [2, 4, 28, 32])
@pytest.mark.parametrize("beta", [2, 7.5, 20])
def test_the_selected_shares_are_kvpress_formula(n_layers, beta):
    """What a layer selects beyond the always-kept tokens is kvpress's layer budget for a
    prompt of ``seen`` tokens with the always-kept tokens as its window and average
    ``budget - always`` (wherever kvpress keeps the pyramid rather than falling back)."""
    compared = 0
    for budget, always, seen in [(512, 32, 4096), (1024, 32, 1500), (2048, 64, 16384)]:
        x = budget - always
        ratio = 1 - x / seen
        for i in range(n_layers):
            ref = kvpress_layer_budget(seen, always, ratio, beta, i, n_layers)
            if ref is not None:
                assert layer_budget(budget, always, n_layers, beta, seen, i) == always + ref
                compared += 1
    assert compared >= n_layers


def test_the_layers_keep_the_stated_budget_together():
    rng = np.random.default_rng(0)
    for _ in range(3000):
        budget = int(rng.integers(2, 5000))
        always = int(rng.integers(0, budget))
        n, seen = int(rng.integers(1, 90)), int(rng.integers(0, 20000))
        beta = float(rng.choice([1.0, 1.5, 3.0, 20.0, 33.3, 1000.0]))
        b = layer_budgets(budget, always, n, beta, seen)
        assert sum(b) == n * min(budget, max(seen, always))  # exactly, rounding included
        assert all(x >= y for x, y in itertools.pairwise(b))  # falls with depth
        assert min(b) >= always and max(b) <= max(seen, always)
        if seen > budget and beta > 1 and n > 1 and budget - always >= 2 * n:
            assert b[0] > budget > b[-1]


# -- one layer: SnapKV's rule with the layer's budget -------------------------------------------
@pytest.mark.parametrize("layer", [0, 1, 2, 3])
def test_each_layer_keeps_snapkvs_choice_at_its_own_budget(layer):
    """The whole prompt in one chunk, then the cut: the kept tokens are SnapKV's (softmax of
    the window's queries over the prompt, summed over the window, averaged over each KV
    head's query heads, average-pooled, top ``b - window``, plus the window), with ``b`` the
    layer's pyramid budget, not the average."""
    t, h, r, window, budget, kernel = 300, 2, 2, 16, 80, 5
    k, v = kv_data(h=h, t=t + 1, d=D, seed=5, dtype=mx.float32)
    q = mx.random.normal((1, h * r, t, D), key=mx.random.key(5)) + k[:, :1, -2:-1] / 4
    c = PyramidKVCache(
        budget=budget, observe=window, kernel=kernel, pooling="avg", layer=layer, n_layers=4
    )
    ev.feed_attending(c, k[:, :, :t], v[:, :, :t], q, chunk=t)
    c.update_and_fetch(k[:, :, t:], v[:, :, t:])
    b = layer_budgets(budget, window, 4, 20, t)[layer]
    # X = 64: 124.8, 84.27, 43.73, 3.2 (step 40.53) rounded
    assert b == [16 + 125, 16 + 84, 16 + 44, 16 + 3][layer]
    votes = refs.window_votes_reference(k, q, t, window, SCALE)[:, : t - window]
    for i in range(h):
        pooled = refs.pool1d_reference(votes[i], kernel, "avg")
        top = np.argsort(-pooled, kind="stable")[: b - window]
        got = kept(c, i, below=t)
        assert len(got) == b and set(range(t - window, t)) <= got
        assert got - set(range(t - window, t)) == set(top.tolist())


def test_shallow_layers_keep_what_deep_layers_drop():
    """Deeper layers keep a subset of what shallower ones keep when their votes agree: the
    same data in every layer, nested budgets."""
    k, v = kv_data(h=2, t=401, d=D, seed=3, dtype=mx.float32)
    q = mx.random.normal((1, 4, 400, D), key=mx.random.key(3)) + k[:, :1, -2:-1] / 4
    sets = []
    for layer in range(4):
        c = PyramidKVCache(budget=96, observe=16, kernel=1, layer=layer, n_layers=4)
        ev.feed_attending(c, k[:, :, :400], v[:, :, :400], q, chunk=400)
        c.update_and_fetch(k[:, :, 400:], v[:, :, 400:])
        sets.append(kept(c, 0, below=400))
    sizes = [len(s) for s in sets]
    assert sizes == layer_budgets(96, 16, 4, 20, 400)
    assert all(a > b for a, b in itertools.pairwise(sizes))
    assert all(deep <= shallow for shallow, deep in itertools.pairwise(sets))


# -- in a model ----------------------------------------------------------------------------------
def test_chunked_prefill_in_a_tiny_model_keeps_the_models_budget():
    """Four layers, prefill in 64-token chunks with routed attention: each layer is placed
    by make_cache, holds at most its budget plus a chunk, and after the prompt the layers
    keep the pyramid: together exactly 4 x budget, the bottom layer the most."""
    model = tiny_model("llama", num_hidden_layers=4)
    prompt = mx.random.randint(0, 512, (1, 300), key=mx.random.key(0))
    budget, chunk, observe = 96, 64, 16
    caches = make_cache(model, PyramidKVCache(budget=budget, observe=observe))
    assert [(c.cfg.layer, c.cfg.n_layers) for c in caches] == [(i, 4) for i in range(4)]
    with routed(model):
        for s in ev.prefill_checked(model, caches, prompt, chunk):
            for i, c in enumerate(caches):
                assert c.size() <= layer_budget(budget, observe, 4, 20, s, i) + chunk
        model(prompt[:, -1:], cache=caches)
    want = layer_budgets(budget, observe, 4, 20, 300)
    sizes = [c.size() - 1 for c in caches]  # less the last prompt token, stored after the cut
    assert sizes == want and sum(sizes) == 4 * budget
    assert sizes[0] > budget > sizes[-1] and sizes == sorted(sizes, reverse=True)
    assert all(c.offset == 301 and max(kept(c, 1)) == 300 for c in caches)
    # bytes: fp16 keys and values of 2 KV heads plus an int32 position, per kept token
    per_token = 2 * (2 * D * 2 + 4)
    assert sum(c.logical_nbytes for c in caches) == (4 * budget + 4) * per_token
    assert all(c.policy.nbytes == 0 for c in caches)  # no decode cuts: no queries kept


def test_the_pyramid_spans_only_the_layers_it_holds():
    """gemma3's sliding-window layers keep the model's own cache: the two global layers make
    the pyramid (places 0 and 1 of 2) and together keep 2 x budget."""
    model = tiny_model("gemma3")
    caches = make_cache(model, PyramidKVCache(budget=64, observe=8))
    ours = [c for c in caches if isinstance(c, PyramidKVCache)]
    assert len(ours) == 2 and [(c.cfg.layer, c.cfg.n_layers) for c in ours] == [(0, 2), (1, 2)]
    prompt = mx.random.randint(0, 512, (1, 200), key=mx.random.key(1))
    with routed(model):
        model(prompt, cache=caches)
        model(prompt[:, -1:], cache=caches)
    sizes = [c.size() - 1 for c in ours]
    assert sizes == layer_budgets(64, 8, 2, 20, 200) and sum(sizes) == 2 * 64
    assert sizes[0] > sizes[1]


def test_beta_one_is_a_uniform_budget():
    model = tiny_model("llama", num_hidden_layers=3)
    caches = make_cache(model, "pyramidkv:budget=40,observe=8,beta=1")
    prompt = mx.random.randint(0, 512, (1, 120), key=mx.random.key(2))
    with routed(model):
        model(prompt, cache=caches)
        model(prompt[:, -1:], cache=caches)
    assert [c.size() for c in caches] == [41, 41, 41]


def test_place_is_saved_and_votes_after_loading(tmp_path):
    model = tiny_model("llama", num_hidden_layers=3)
    prompt = mx.random.randint(0, 512, (1, 160), key=mx.random.key(3))
    caches = make_cache(model, PyramidKVCache(budget=48, observe=8, every=8))
    with routed(model):
        model(prompt[:, :150], cache=caches)  # the cut pending
    save_cache(tmp_path / "c.safetensors", caches)
    loaded = load_cache(tmp_path / "c.safetensors")
    assert [c.config() for c in loaded] == [c.config() for c in caches]
    assert [c.policy.config() for c in loaded] == [c.policy.config() for c in caches]
    with routed(model):
        a = model(prompt[:, 150:], cache=caches)
        b = model(prompt[:, 150:], cache=loaded)
    assert [c.size() for c in loaded] == [c.size() for c in caches]
    assert rel_error(a, b) < 1e-3
    assert [kept(c, 0) for c in loaded] == [kept(c, 0) for c in caches]


# -- without a model -----------------------------------------------------------------------------
def test_without_a_place_a_cut_is_refused_naming_make_cache():
    k, v = kv_data(t=300, d=D)
    q = mx.random.normal((1, 4, 300, D), key=mx.random.key(0))
    c = PyramidKVCache(budget=400, observe=8)  # the prompt fits: no place needed
    with routed():
        ev.feed_attending(c, k, v, q, chunk=150)
    assert c.size() == 300
    c = PyramidKVCache(budget=64, observe=8)
    with routed():
        ev.feed_attending(c, k[:, :, :299], v[:, :, :299], q, chunk=299)
        with pytest.raises(ValueError, match=r"make_cache\(model"):
            c.update_and_fetch(k[:, :, 299:], v[:, :, 299:])
    with pytest.raises(ValueError, match=r"make_cache\(model"):
        PyramidKVCache(budget=64).bind(None, 1)
    given = PyramidKVCache(budget=64, observe=8, layer=0, n_layers=3)
    given.bind(None, 2)  # the layer given by bind, the pyramid's height by hand
    assert (given.cfg.layer, given.cfg.n_layers) == (2, 3)
    with routed():
        ev.feed_attending(given, k[:, :, :299], v[:, :, :299], q, chunk=299)
        given.update_and_fetch(k[:, :, 299:], v[:, :, 299:])
    assert given.size() == layer_budget(64, 8, 3, 20, 299, 2) + 1


def test_the_cut_needs_routed_attention():
    ev.assert_cut_needs_routing(
        lambda: PyramidKVCache(budget=40, observe=8, layer=0, n_layers=2), t=300, d=D
    )


def test_decode_cuts_keep_each_layer_within_its_budget_plus_every():
    k, v = kv_data(t=260, d=D, dtype=mx.float32)
    q = mx.random.normal((1, 4, 260, D), key=mx.random.key(1))
    for layer in (0, 2):
        c = PyramidKVCache(budget=48, observe=8, every=4, layer=layer, n_layers=3)
        ev.feed_attending(c, k, v, q, chunk=200, stop=200)
        sizes = ev.decode_attending(c, k, v, q, 200, 260)
        for i, size in zip(range(200, 260), sizes):
            assert size <= layer_budget(48, 8, 3, 20, i, layer) + 4
        assert c.size() >= layer_budget(48, 8, 3, 20, 259, layer)


def test_composes_with_sinks_a_window_and_codes():
    """sinks=4 and window=8 are kept in every layer; the pyramid shares out the rest."""
    k, v = kv_data(h=2, t=401, d=D, seed=8, dtype=mx.float32)
    q = mx.random.normal((1, 4, 400, D), key=mx.random.key(8))
    c = PyramidKVCache(budget=64, sinks=4, window=8, observe=16, bits=4, layer=3, n_layers=4)
    assert c.policy.always == 4 + 16
    ev.feed_attending(c, k[:, :, :400], v[:, :, :400], q, chunk=128)
    c.update_and_fetch(k[:, :, 400:], v[:, :, 400:])
    kk, _ = c.keys_and_values()
    assert mx.array_equal(kk[:, :, :4], k[:, :, :4].astype(kk.dtype))  # the sinks, as given
    assert c.size() == layer_budget(64, 20, 4, 20, 400, 3) + 1
    assert set(range(384, 400)) <= kept(c, 0) | set(range(392, 401))


def test_recommended_settings_and_registry():
    assert METHOD.name == "pyramidkv" and METHOD.paper == "https://arxiv.org/abs/2406.02069"
    fp16, _ = ev.recommended_presets(METHOD, voted=True)
    assert fp16.policy.config() == {
        "budget": 1024,
        "every": None,
        "beta": 20.0,
        "layer": None,
        "n_layers": None,
        "observe": 32,
        "kernel": 15,
        "pooling": "max",
    }


def test_bad_policy_settings():
    ev.assert_vote_settings_refused(PyramidKVPolicy)
    with pytest.raises(ValueError, match="beta"):
        PyramidKVPolicy(budget=64, beta=0.9)
    with pytest.raises(ValueError, match="n_layers"):
        PyramidKVPolicy(budget=64, layer=0)
    assert math.isclose(PyramidKVPolicy(budget=64, beta=3).beta, 3.0)


def test_a_file_in_the_saved_format_loads(tmp_path):
    """The policy's saved state is SnapKV's: the array "policy.queries" and policy meta
    "chunk_pending", "q_end" and "scale" (the place is part of the config). A file whose
    policy state is written by hand in that format cuts as the cache it was saved from."""
    k, v = kv_data(t=301, d=D, seed=3)
    q = mx.random.normal((1, 4, 301, D), key=mx.random.key(4))
    c = PyramidKVCache(budget=48, observe=8, every=16, layer=1, n_layers=3)
    ev.feed_attending(c, k, v, q, chunk=150, stop=300)
    path = tmp_path / "c.safetensors"
    save_cache(path, [c])
    arrays, header = mx.load(str(path), return_metadata=True)
    layers = json.loads(header["layers"])
    assert [a for a in arrays if ".policy." in a] == ["layer0.policy.queries"]
    assert layers[0]["meta"]["policy_meta"] == {"chunk_pending": True, "q_end": 300, "scale": SCALE}
    arrays["layer0.policy.queries"] = q[:, :, 292:300]  # the newest 8 queries, by hand
    layers[0]["meta"]["policy_meta"] = {"chunk_pending": True, "q_end": 300, "scale": SCALE}
    header["layers"] = json.dumps(layers)
    header["sha256"] = _digest(arrays, header)
    mx.save_safetensors(str(path), arrays, header)
    (d,) = load_cache(path)
    for x in (c, d):
        x.update_and_fetch(k[:, :, 300:], v[:, :, 300:])
    assert kept(c, 0) == kept(d, 0) and kept(c, 1) == kept(d, 1)
    assert c.size() == d.size() < 300
