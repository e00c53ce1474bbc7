"""What velox-vlm refuses (mlx-vlm's KV quantization, draft models, batches), what it accepts
(mlx-vlm's own default settings, which its command line passes), the install path through
mlx-vlm's own generate, and save/load of a velox-vlm cache list with Gemma 3's sliding-window
layers."""

from __future__ import annotations

import inspect

import mlx.core as mx
import mlx_vlm
import pytest
from _vlm_util import PROMPT, model_of, tokens
from mlx_vlm.generate import PromptCacheState, ar
from mlx_vlm.models.cache import KVCache, RotatingKVCache

import velox_core
import velox_vlm

SPEC = "uniform:bits=8"
IDS = mx.array([PROMPT[:40]], dtype=mx.int32)
GEN = {"input_ids": IDS, "max_tokens": 3, "temperature": 0.0}

# one value of each refused option or setting that asks for what velox caches cannot serve
REFUSED_VALUES = {
    "kv_bits": 4,
    "kv_key_bits": 4,
    "kv_value_bits": 8,
    "draft_model": object(),
    "max_kv_size": 64,
    "apc_manager": object(),
    "kv_group_size": 32,
    "kv_quant_scheme": "turboquant",
    "quantized_kv_start": 100,
    "kv_key_scheme": "uniform",
    "kv_value_scheme": "turboquant",
    "draft_kind": "eagle3",
    "draft_block_size": 4,
}


def test_every_refused_option_has_a_value_here():
    assert set(REFUSED_VALUES) == set(velox_vlm.REFUSED) | set(velox_vlm.COMPANIONS)


@pytest.mark.parametrize("option", sorted(REFUSED_VALUES))
def test_velox_vlm_generate_refuses_before_anything_runs(option, processor):
    model = model_of("qwen2_vl")
    caches = velox_vlm.make_cache(model, SPEC)
    kw = {**GEN, option: REFUSED_VALUES[option]}
    with pytest.raises(ValueError, match=f"velox caches cannot be combined with {option}"):
        list(velox_vlm.stream_generate(model, processor, "", cache=caches, **kw))
    with pytest.raises(ValueError, match=f"velox caches cannot be combined with {option}"):
        velox_vlm.generate(model, processor, "", cache=caches, **kw)
    assert all(c.offset == 0 for c in caches)  # nothing stored


def test_mlx_vlm_default_settings_are_accepted(processor):
    """The settings mlx-vlm's command line and server pass on every call, at its defaults
    (they do nothing without kv_bits or a draft model): the run is the same as without them."""
    model = model_of("qwen2_vl")
    defaults = {
        "kv_group_size": 64,
        "kv_quant_scheme": "uniform",
        "quantized_kv_start": 5000,
        "draft_kind": "dflash",
        "kv_bits": None,
        "draft_model": None,
        "max_kv_size": None,
    }
    ref, _ = tokens(velox_vlm.stream_generate(model, processor, "", cache=SPEC, **GEN))
    got, _ = tokens(velox_vlm.stream_generate(model, processor, "", cache=SPEC, **GEN, **defaults))
    assert got == ref and len(got) == 3
    velox_vlm.check_options({"quantized_kv_start": 0, "kv_key_scheme": None})  # batch defaults


def test_companion_defaults_are_mlx_vlm_s():
    """COMPANIONS' accepted values are the defaults of mlx-vlm's generate_step and
    BatchGenerator (a new mlx-vlm default would be refused otherwise)."""
    for fn in (ar.generate_step, ar.BatchGenerator.__new__):
        params = inspect.signature(getattr(fn, "__velox_original__", fn)).parameters
        for name, (allowed, _) in velox_vlm.COMPANIONS.items():
            if name in params:
                default = params[name].default
                assert default is None or default in allowed, (fn.__name__, name, default)


def test_more_than_one_sequence_is_refused(processor):
    model = model_of("qwen2_vl")
    ids = mx.concatenate([IDS, IDS])
    with pytest.raises(ValueError, match="input_ids hold 2 sequences"):
        list(
            velox_vlm.stream_generate(model, processor, "", cache=SPEC, **{**GEN, "input_ids": ids})
        )


@pytest.fixture
def installed():
    model = model_of("qwen2_vl")
    velox_vlm.install(model, SPEC)
    try:
        yield model
    finally:
        velox_vlm.uninstall(model)


def test_install_gives_mlx_vlm_s_own_generate_velox_caches(installed, processor):
    """mlx-vlm's stream_generate, given no caches, makes the installed velox caches and
    attends through them: the tokens and log-probabilities of velox_vlm.stream_generate."""
    model = installed
    state = PromptCacheState()
    got, got_lp = tokens(
        mlx_vlm.stream_generate(model, processor, "", **GEN, prompt_cache_state=state)
    )
    lm_layers = model.language_model.layers
    assert len(state.cache) == len(lm_layers)
    assert all(isinstance(c, velox_core.UniformCache) for c in state.cache)
    assert state.cache[0].offset == IDS.shape[1] + 3
    ref, ref_lp = tokens(velox_vlm.stream_generate(model, processor, "", cache=SPEC, **GEN))
    assert got == ref
    assert all(mx.array_equal(a, b) for a, b in zip(got_lp, ref_lp))


def test_uninstall_restores_mlx_vlm_s_caches_and_functions(processor):
    model = model_of("qwen2_vl")
    before = (mlx_vlm.stream_generate, ar.generate_step)
    velox_vlm.install(model, SPEC)
    assert mlx_vlm.stream_generate is not before[0]
    velox_vlm.uninstall(model)
    assert (mlx_vlm.stream_generate, ar.generate_step) == before
    state = PromptCacheState()
    list(mlx_vlm.stream_generate(model, processor, "", **GEN, prompt_cache_state=state))
    assert all(type(c) is KVCache for c in state.cache)
    ar.BatchGenerator(model, processor).close()  # mlx-vlm's batch path serves it again
    velox_vlm.uninstall(model)  # a second uninstall does nothing


@pytest.mark.parametrize("option", ["kv_bits", "draft_model", "kv_group_size", "max_kv_size"])
def test_installed_mlx_vlm_generate_refuses(installed, option, processor):
    kw = {**GEN, option: REFUSED_VALUES[option]}
    match = f"with velox caches: velox caches cannot be combined with {option}"
    with pytest.raises(ValueError, match=match):
        list(mlx_vlm.stream_generate(installed, processor, "", **kw))
    with pytest.raises(ValueError, match=match):
        mlx_vlm.generate(installed, processor, "", **kw)
    with pytest.raises(ValueError, match=match):
        next(ar.generate_step(IDS, installed, None, None, **{option: REFUSED_VALUES[option]}))
    # mlx-vlm's defaults, passed as its command line passes them, are accepted
    defaults = {"kv_group_size": 64, "kv_quant_scheme": "uniform", "quantized_kv_start": 5000}
    out = list(mlx_vlm.stream_generate(installed, processor, "", **GEN, **defaults))
    assert len(out) == 4


def test_installed_model_refuses_mlx_vlm_s_batch_path(installed, processor):
    with pytest.raises(ValueError, match="BatchGenerator: velox caches serve"):
        ar.BatchGenerator(installed, processor)
    ar.BatchGenerator(model_of("gemma3"), processor)  # a model without velox caches


def test_save_load_keeps_gemma3_s_sliding_windows_and_the_next_tokens(tmp_path, processor):
    """A velox-vlm cache list of Gemma 3 (velox caches on its global layers, mlx-vlm's
    RotatingKVCache on its sliding-window layers, wrapped past its 16-token window) saved and
    loaded: the same classes and states, and the next tokens' log-probabilities equal."""
    model = model_of("gemma3")
    caches = velox_vlm.make_cache(model, SPEC)
    list(velox_vlm.stream_generate(model, processor, "", cache=caches, **GEN))
    rot = [c for c in caches if type(c) is RotatingKVCache]
    assert rot and all(c.offset > c.max_size for c in rot)
    path = tmp_path / "vlm.safetensors"
    velox_core.save_cache(path, caches, {"turn": "1"})
    loaded, meta = velox_core.load_cache(path, return_metadata=True, model=model)
    assert meta == {"turn": "1"}
    assert [type(c) for c in loaded] == [type(c) for c in caches]
    for a, b in zip(caches, loaded):
        assert a.offset == b.offset
        if type(a) is RotatingKVCache:
            assert a.meta_state == b.meta_state
            assert all(mx.array_equal(x, y) for x, y in zip(a.state, b.state))
    lm = model.language_model
    nxt = [[t] for t in PROMPT[40:44]]
    with velox_core.routed(model):
        for t in nxt:
            a = lm(mx.array([t], dtype=mx.int32), cache=caches).logits
            b = lm(mx.array([t], dtype=mx.int32), cache=loaded).logits
            assert mx.array_equal(a, b)
    with pytest.raises(ValueError, match="4 cached layers for a model of 2 layers"):
        velox_core.load_cache(path, model=model_of("qwen2_vl"))
