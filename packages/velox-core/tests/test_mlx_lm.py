"""mlx-lm integration: per-layer caches, reversible routing, families, generate."""

import sys

import mlx.core as mx
import pytest
from mlx_lm.models.cache import KVCache, RotatingKVCache

import velox_core
from velox_core import UniformCache, VeloxCache, disable, enable, make_cache, routed
from velox_core.routing import is_enabled
from velox_testing import FAMILIES, greedy_agreement, tiny_model, tiny_tokenizer


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_families_generate_and_uniform8_keeps_greedy_tokens(family):
    model = tiny_model(family)
    caches = make_cache(model, "uniform:bits=4")
    text = velox_core.generate(
        model, tiny_tokenizer(), "def add(a, b):", cache=caches, max_tokens=5
    )
    assert isinstance(text, str)
    velox = [c for c in caches if isinstance(c, VeloxCache)]
    assert velox and all(c.offset > 5 for c in velox)
    prompt = mx.random.randint(0, 512, (1, 48), key=mx.random.key(8))
    ref, got, ties = greedy_agreement(model, prompt, UniformCache(bits=8), steps=32)
    assert len(set(ref)) > 3
    assert all(a == b or t for a, b, t in zip(ref, got, ties)), (ref, got)
    assert sum(a == b for a, b in zip(ref, got)) >= 30


def test_sliding_window_layers_keep_their_cache():
    model = tiny_model("gemma3")
    caches = make_cache(model, "uniform")
    kinds = [type(c) for c in caches]
    assert kinds == [RotatingKVCache, UniformCache, RotatingKVCache, UniformCache]


def test_per_layer_choice_and_fresh_caches():
    model = tiny_model("llama", num_hidden_layers=4)
    template = UniformCache(bits=2)
    caches = make_cache(model, default=template, layers={0: None, -1: "uniform:bits=8"})
    assert type(caches[0]) is KVCache
    assert caches[1].config()["bits"] == 2 and caches[1] is not template
    assert caches[1] is not caches[2]
    assert caches[3].config()["bits"] == 8
    caches2 = make_cache(model, default=lambda i: UniformCache(bits=4 + i % 2))
    assert [c.config()["bits"] for c in caches2] == [4, 5, 4, 5]
    with pytest.raises(ValueError, match="out of range"):
        make_cache(model, layers={4: None})
    with pytest.raises(TypeError):
        make_cache(model, default=3.5)
    with pytest.raises(ValueError, match="unknown method"):
        make_cache(model, default="nope:bits=4")


def test_routing_is_explicit_and_reversible():
    import mlx_lm.models.base as base
    import mlx_lm.models.llama as llama

    original = llama.scaled_dot_product_attention
    assert original is base.scaled_dot_product_attention
    assert not is_enabled()
    model = tiny_model("llama")
    with routed(model):
        assert llama.scaled_dot_product_attention is not original
        enable()
        disable()
        assert llama.scaled_dot_product_attention is not original  # nested: still on
    assert llama.scaled_dot_product_attention is original
    assert base.scaled_dot_product_attention is original
    assert not is_enabled()
    patched = [
        m
        for m in sys.modules
        if m.startswith("mlx_lm.models.")
        and getattr(sys.modules[m], "scaled_dot_product_attention", original) is not original
    ]
    assert patched == []


def test_routing_is_state_on_each_cache_copies_included():
    """routed() sets ``routed`` on every live velox cache (made before or inside the block,
    and deep copies, as batch_generate and the server make them) and clears it on leaving;
    nested blocks keep it on until the outer one ends."""
    import copy

    before = UniformCache(bits=4)
    assert before.routed is False
    with routed():
        inside = UniformCache(bits=4)
        dup = copy.deepcopy(before)
        assert before.routed and inside.routed and dup.routed
        with routed():
            pass
        assert before.routed and dup.routed
    assert not (before.routed or inside.routed or dup.routed)
    after = copy.deepcopy(inside)
    assert after.routed is False


def test_routed_attention_reads_codes_not_fetched_arrays():
    """With routing on, the velox path ignores what update_and_fetch returned."""
    model = tiny_model("llama")
    caches = make_cache(model, "uniform:bits=4")
    calls = []
    orig = UniformCache.attend

    def spy(self, *a, **k):
        calls.append(1)
        return orig(self, *a, **k)

    UniformCache.attend = spy
    try:
        with routed(model):
            model(mx.array([[1, 2, 3]]), cache=caches)
        model(mx.array([[4]]), cache=caches)  # routing off: the model's own attention
    finally:
        UniformCache.attend = orig
    assert len(calls) == len(model.layers)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_routed_caches_of_known_families_skip_the_decoded_fetch(family):
    """make_cache marks the caches of model types whose layers read keys only through the
    shared attention: while routed, update_and_fetch returns the new tokens (no decode graph);
    the logits equal those of caches that build it; unrouted it returns every token decoded."""
    from velox_core.mlx_lm import ROUTED_ONLY_MODEL_TYPES

    model = tiny_model(family)
    assert model.model_type in ROUTED_ONLY_MODEL_TYPES
    fast = make_cache(model, "uniform:bits=4")
    full = make_cache(model, "uniform:bits=4")
    velox = [c for c in fast if isinstance(c, VeloxCache)]
    assert velox and not any(c.fetch_decoded for c in velox)
    for c in full:
        c.fetch_decoded = True
    prompt = mx.random.randint(0, 512, (1, 40), key=mx.random.key(4))
    with routed(model):
        outs = [model(prompt, cache=caches) for caches in (fast, full)]
        for tok in (3, 9, 27):
            outs += [model(mx.array([[tok]]), cache=caches) for caches in (fast, full)]
    for a, b in zip(outs[::2], outs[1::2]):
        assert mx.array_equal(a, b)
    k = mx.random.normal((1, velox[0].stored.dims[1], 1, velox[0].stored.dims[2])).astype(
        mx.float16
    )
    with routed(model):
        got = velox[0].update_and_fetch(k, k)
    assert got[0].shape[2] == 1
    got = velox[0].update_and_fetch(k, k)  # routing off: every stored token, decoded
    assert got[0].shape[2] == velox[0].offset


def test_unknown_model_types_keep_the_decoded_fetch(monkeypatch):
    model = tiny_model("llama")
    monkeypatch.setattr(model, "model_type", "some_new_model")
    caches = make_cache(model, "uniform:bits=4")
    assert all(c.fetch_decoded for c in caches if isinstance(c, VeloxCache))


def test_other_layers_use_original_attention():
    model = tiny_model("llama")
    x = mx.array([[5, 6, 7, 8]])
    ref = model(x, cache=[KVCache() for _ in model.layers])
    with routed(model):
        got = model(x, cache=[KVCache() for _ in model.layers])
    assert mx.array_equal(ref, got)


def test_decode_logits_close_to_fp16_at_8_bits():
    model = tiny_model("qwen3")
    prompt = mx.random.randint(0, 512, (1, 64), key=mx.random.key(0))
    ref = model(prompt, cache=[KVCache() for _ in model.layers])[:, -1].astype(mx.float32)
    with routed(model):
        got = model(prompt, cache=make_cache(model, "uniform:bits=8"))[:, -1].astype(mx.float32)
    assert float(mx.max(mx.abs(got - ref)).item()) < 0.05 * float(mx.max(mx.abs(ref)).item())


def test_make_cache_refuses_a_head_dim_the_method_cannot_code_before_the_first_forward():
    """A head dim the codecs cannot take is refused at make_cache, naming the layer, the head
    dim and the cache (not at the first forward, deep in an encode)."""
    from velox_core import make_cache
    from velox_testing import tiny_model

    model = tiny_model("llama", head_dim=80, hidden_size=160)
    with pytest.raises(ValueError, match=r"layer 0 \(head dim 80\): uniform: group=64 .*80"):
        make_cache(model, "uniform:bits=4")
    caches = make_cache(model, "uniform:bits=4,group=16")  # 16 divides 80
    assert all(c.tiers[0].key_codec.group == 16 for c in caches)


def test_install_gives_mlx_lm_entry_points_velox_caches_until_uninstalled():
    """install: mlx-lm's make_prompt_cache (used by batch_generate and the server) makes
    velox caches and attention is routed; batch_generate then needs no caches passed in;
    uninstall restores the model's own caches and the routing level."""
    from mlx_lm.generate import batch_generate
    from mlx_lm.models.cache import make_prompt_cache

    model = tiny_model("llama")
    with pytest.raises(ValueError, match="nosuch"):
        velox_core.install(model, "nosuch:bits=4")
    assert not hasattr(model, "__velox_installed__") or not model.__velox_installed__
    velox_core.install(model, "uniform:bits=4,window=4")
    try:
        caches = make_prompt_cache(model)
        assert all(type(c) is UniformCache and c.window == 4 for c in caches)
        assert caches[0] is not make_prompt_cache(model)[0] and is_enabled()
        with pytest.raises(ValueError, match="already installed"):
            velox_core.install(model, "uniform:bits=8")
        prompts = [[1, 5, 9, 13, 17, 21, 25], [2, 4], [7, 7, 7, 8]]
        out = batch_generate(model, tiny_tokenizer(), prompts, max_tokens=4, return_token_ids=True)
        assert [len(t) for t in out.token_ids] == [4, 4, 4]
    finally:
        velox_core.uninstall(model)
    assert all(type(c) is KVCache for c in make_prompt_cache(model)) and not is_enabled()


def test_speculative_decoding_gets_draft_caches_and_trimmable_caches_only():
    """generate(draft_model=...) makes the draft model's caches too; mlx-lm's speculative
    decoding trims after every draft, so it refuses caches whose trim is not exact and runs
    with those whose is (every token coded alone on arrival), giving the tokens of the same
    cache without a draft."""
    model, draft = tiny_model("llama"), tiny_model("llama", num_hidden_layers=1)
    tok = tiny_tokenizer()
    assert not UniformCache(bits=4).is_trimmable()
    with pytest.raises(ValueError, match="trimmable"):
        velox_core.generate(model, tok, "def f(x):", cache="uniform:bits=4", draft_model=draft)
    exact = "uniform:bits=8,flush=1"
    assert velox_core.make(exact).is_trimmable()
    plain = velox_core.generate(model, tok, "def f(x):", cache=exact, max_tokens=12)
    spec = velox_core.generate(
        model, tok, "def f(x):", cache=exact, max_tokens=12, draft_model=draft
    )
    assert spec == plain


def test_latent_attention_layers_get_a_latent_cache_for_uniform_and_fp16_otherwise():
    """DeepSeek-V3's multi-head latent attention caches a latent (kv_lora_rank channels, one
    head) and a RoPE key, then attends with projections of them: a uniform spec gives those
    layers a LatentCache (packed codes, returned decoded; test_latent_cache.py); any other
    spec leaves them to the model's KVCache with one warning per model naming the layers and
    why. generate with a velox spec gives the fp16 cache's tokens."""
    import warnings

    import mlx_lm

    from velox_core import LatentCache, Uniform, VeloxCache
    from velox_core.router import layer_routes

    model = tiny_model("deepseek_v3")
    routes = layer_routes(model)
    assert [(r.routed, r.key_dim, r.value_dim, r.latent) for r in routes.values()] == [
        (False, 64, 16, True)
    ] * 2
    caches = make_cache(model, "uniform:bits=4")
    assert [type(c) for c in caches] == [LatentCache, LatentCache]
    template = VeloxCache(Uniform(4), Uniform(4))
    with pytest.warns(UserWarning, match=r"layers 0, 1 keep the model's own cache.*latent"):
        caches = make_cache(model, template)
    assert [type(c) for c in caches] == [KVCache, KVCache]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # said once per model
        make_cache(model, template, layers={0: VeloxCache(Uniform(8), Uniform(8))})
    tok = tiny_tokenizer()
    prompt = mx.random.randint(0, 512, (40,), key=mx.random.key(3)).tolist()
    got = velox_core.generate(model, tok, prompt, cache="uniform:bits=8", max_tokens=8)
    ref = mlx_lm.generate(model, tok, prompt, max_tokens=8)
    assert got == ref and len(ref) > 0


def test_layers_with_their_own_attention_keep_velox_caches_without_a_policy():
    """Gemma 2 computes attention itself (logit soft-capping) from what update_and_fetch
    returns: a codec-only velox cache serves it (decoded tokens, nothing routed) and follows the
    fp16 tokens at 8 bits; a cache with a retention policy, which needs the queries only routed
    attention shows it, is refused there with a warning and the layer keeps its KVCache."""
    from velox_core import RetentionPolicy
    from velox_core.router import layer_routes

    model = tiny_model("gemma2")
    assert not any(r.routed for r in layer_routes(model).values())
    caches = make_cache(model, "uniform:bits=8")
    assert all(type(c) is UniformCache and c.fetch_decoded for c in caches)
    prompt = mx.random.randint(0, 512, (1, 80), key=mx.random.key(8))  # past one flush
    fp16 = [KVCache() for _ in model.layers]
    outs = []
    with routed(model):
        for x in (prompt, mx.array([[5]]), mx.array([[9]])):
            ref = model(x, cache=fp16)[:, -1].astype(mx.float32)
            got = model(x, cache=caches)[:, -1].astype(mx.float32)
            outs.append(float(mx.max(mx.abs(got - ref)).item()) / float(mx.max(mx.abs(ref)).item()))
    assert max(outs) < 0.05, outs
    assert caches[0].size() == 82 and caches[0].stored.coded[0][0].tokens > 0  # coded, then decoded
    template = VeloxCache(policy=RetentionPolicy(budget=32))
    with pytest.warns(UserWarning, match=r"own cache .*retention policy needs the queries"):
        caches = make_cache(model, template)
    assert [type(c) for c in caches] == [KVCache, KVCache]


def test_make_cache_checks_the_dims_the_layer_stores():
    """The head dims checked at make_cache are those the layer's attention stores (probed),
    not a guess from the config: a model whose head_dim differs from hidden / heads."""
    model = tiny_model("llama", head_dim=48, hidden_size=128)  # 128 / 4 heads = 32
    with pytest.raises(ValueError, match=r"layer 0 \(head dim 48\): uniform: group=32 .* 48"):
        make_cache(model, "uniform:bits=4,group=32")
    assert all(isinstance(c, UniformCache) for c in make_cache(model, "uniform:group=16"))
