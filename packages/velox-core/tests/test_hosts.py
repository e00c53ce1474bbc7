"""velox-core's hosts (velox_core.hosts) with a made-up library, ``toyvl``, whose models work
as mlx-vlm's do (a whole model holding a ``language_model``, a shared attention function in
``toyvl.models.base`` imported by name, its own plain KV cache class and another cache kept
for some layers), without mlx-vlm: make_cache, routing, layer_routes, install, save/load,
registration and the entry points."""

from __future__ import annotations

import sys
import types
import warnings

import mlx.core as mx
import pytest

import velox_core
from velox_core import hosts as H
from velox_core import router, routing
from velox_core.hosts import MLX_LM, Host, add_host, get_host, host_of

_BASE = '''
import mlx.core as mx
from mlx_lm.models.cache import KVCache as _KV


class KVCache(_KV):
    """toyvl's plain cache (a class of its own)."""


class SideCache(_KV):
    """Another cache of toyvl's (a layer velox must leave alone)."""


def scaled_dot_product_attention(queries, keys, values, cache, scale, mask, sinks=None):
    return mx.fast.scaled_dot_product_attention(queries, keys, values, scale=scale, mask=mask)
'''

_TOY = '''
import mlx.core as mx
import mlx.nn as nn

from toyvl.models.base import KVCache, SideCache, scaled_dot_product_attention


class Attention(nn.Module):
    def __init__(self, dim, heads, kv_heads):
        super().__init__()
        self.heads, self.kv_heads, self.hd = heads, kv_heads, 64
        self.q = nn.Linear(dim, heads * self.hd, bias=False)
        self.k = nn.Linear(dim, kv_heads * self.hd, bias=False)
        self.v = nn.Linear(dim, kv_heads * self.hd, bias=False)
        self.o = nn.Linear(heads * self.hd, dim, bias=False)

    def __call__(self, x, mask, cache):
        b, n, _ = x.shape
        q = self.q(x).reshape(b, n, self.heads, -1).transpose(0, 2, 1, 3)
        k = self.k(x).reshape(b, n, self.kv_heads, -1).transpose(0, 2, 1, 3)
        v = self.v(x).reshape(b, n, self.kv_heads, -1).transpose(0, 2, 1, 3)
        rope = {"traditional": False, "base": 1e4, "scale": 1.0, "offset": cache.offset}
        q, k = (mx.fast.rope(a, self.hd, **rope) for a in (q, k))
        k, v = cache.update_and_fetch(k, v)
        out = scaled_dot_product_attention(q, k, v, cache=cache, scale=self.hd**-0.5, mask=mask)
        return self.o(out.transpose(0, 2, 1, 3).reshape(b, n, -1))


class Block(nn.Module):
    def __init__(self, dim, heads, kv_heads):
        super().__init__()
        self.attn = Attention(dim, heads, kv_heads)
        self.mlp = nn.Linear(dim, dim, bias=False)

    def __call__(self, x, mask, cache):
        x = x + self.attn(x, mask, cache)
        return x + self.mlp(nn.gelu(x))


class LanguageModel(nn.Module):
    def __init__(self, vocab=64, dim=128, heads=4, kv_heads=2, n_layers=3):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.layers = [Block(dim, heads, kv_heads) for _ in range(n_layers)]
        self.head = nn.Linear(dim, vocab, bias=False)

    def __call__(self, tokens, cache=None):
        cache = cache or self.make_cache()
        x = self.embed(tokens)
        mask = "causal" if tokens.shape[1] > 1 else None
        for layer, c in zip(self.layers, cache):
            x = layer(x, mask, c)
        return self.head(x)

    def make_cache(self):
        # the last layer keeps a cache of another kind (a sliding window's, say)
        return [KVCache() for _ in self.layers[:-1]] + [SideCache()]


class Model(nn.Module):
    """A whole toyvl model: its language model under ``language_model``."""

    def __init__(self):
        super().__init__()
        self.language_model = LanguageModel()
        self.vision = nn.Linear(8, 128)

    def __call__(self, tokens, cache=None):
        return self.language_model(tokens, cache=cache)
'''


def _module(name: str, source: str) -> types.ModuleType:
    mod = types.ModuleType(name)
    sys.modules[name] = mod
    exec(compile(source, f"<{name}>", "exec"), mod.__dict__)
    return mod


for _pkg in ("toyvl", "toyvl.models"):
    sys.modules.setdefault(_pkg, types.ModuleType(_pkg))
base = _module("toyvl.models.base", _BASE)
toy = _module("toyvl.models.toy", _TOY)


def _toy_host(name: str = "toyvl") -> Host:
    return Host(
        name=name,
        owns=lambda m: type(m).__module__.startswith("toyvl."),
        attention=("toyvl.models.base", "toyvl.models."),
        plain_cache=base.KVCache,
        is_plain=lambda c: type(c) is base.KVCache,
        language_model=lambda m: getattr(m, "language_model", m),
        saved_classes=lambda: {"KVCache": base.KVCache, "SideCache": base.SideCache},
        generate="toyvl_velox.generate",
    )


@pytest.fixture
def host(monkeypatch):
    # the registry as it was, afterwards: its hosts and whether the entry points were read (a
    # save or load reads them into the copy; a "read" flag left behind would hide them after)
    monkeypatch.setattr(H, "_hosts", dict(H._hosts))
    monkeypatch.setattr(H, "_loaded", H._loaded)
    return add_host(_toy_host())


@pytest.fixture(scope="module")
def model():
    mx.random.seed(0)
    m = toy.Model()
    mx.eval(m.parameters())
    return m


PROMPT = mx.array([[(5 * i + 1) % 64 for i in range(40)]], dtype=mx.int32)


def _run(model, caches, steps=(3, 9)):
    """Logits of the prompt's last token and of a few single tokens after it."""
    out = [model(PROMPT, cache=caches)[:, -1]]
    for t in steps:
        out.append(model(mx.array([[t]], dtype=mx.int32), cache=caches)[:, -1])
    return mx.concatenate(out).astype(mx.float32)


def test_host_of_finds_the_registered_host(host, model):
    assert host_of(model) is host and host_of(model.language_model) is host
    assert get_host("toyvl") is host
    from velox_testing import tiny_model

    assert host_of(tiny_model("llama")) is MLX_LM


def test_make_cache_serves_the_host_s_language_model(host, model):
    caches = velox_core.make_cache(model, "uniform:bits=8")
    assert len(caches) == len(model.language_model.layers)
    assert all(isinstance(c, velox_core.UniformCache) for c in caches[:-1])
    assert type(caches[-1]) is base.SideCache  # not the host's plain cache: kept
    # "fp16" and None give the host's plain cache, not mlx-lm's
    plain = velox_core.make_cache(model, "fp16")
    assert [type(c) for c in plain] == [base.KVCache, base.KVCache, base.SideCache]
    routes = router.layer_routes(model)
    assert sorted(routes) == [0, 1] and all(r.routed for r in routes.values())  # plain layers


def test_routing_sends_the_host_s_attention_to_velox_caches(host, model, monkeypatch):
    """Under routing the host's shared attention function (imported by name in its model
    module) reaches VeloxCache.attend; the logits of a velox cache that keeps every token as
    given match the host's own caches; routing off restores the function."""
    calls = []
    attend = velox_core.VeloxCache.attend

    def counting(self, *a, **k):
        calls.append(self)
        return attend(self, *a, **k)

    monkeypatch.setattr(velox_core.VeloxCache, "attend", counting)
    original = toy.scaled_dot_product_attention
    ref = _run(model, model.language_model.make_cache())
    caches = velox_core.make_cache(model, velox_core.VeloxCache())  # Identity codecs
    with velox_core.routed(model):
        assert toy.scaled_dot_product_attention is not original
        got = _run(model, caches)
    assert toy.scaled_dot_product_attention is original
    assert len(calls) == 2 * 3  # two velox layers, three calls
    assert mx.allclose(got, ref, atol=2e-2, rtol=2e-2)


def test_install_sets_the_language_model_s_make_cache(host, model):
    lm = model.language_model
    velox_core.install(model, "uniform:bits=4")
    try:
        assert routing.is_enabled()
        made = lm.make_cache()
        assert all(isinstance(c, velox_core.UniformCache) for c in made[:-1])
        assert type(made[-1]) is base.SideCache
        with pytest.raises(ValueError, match="already installed"):
            velox_core.install(model, "uniform:bits=4")
    finally:
        velox_core.uninstall(model)
    assert not routing.is_enabled()
    assert [type(c) for c in lm.make_cache()] == [base.KVCache, base.KVCache, base.SideCache]


def test_generate_refuses_another_host_s_model(host, model):
    with pytest.raises(TypeError, match="this is a toyvl model: use toyvl_velox.generate"):
        velox_core.generate(model, None, "hello")


def test_save_load_rebuilds_the_host_s_kept_caches(host, model, tmp_path):
    caches = velox_core.make_cache(model, "uniform:bits=8")
    with velox_core.routed(model):
        model(PROMPT, cache=caches)
    path = tmp_path / "toy.safetensors"
    velox_core.save_cache(path, caches)
    loaded = velox_core.load_cache(path, model=model.language_model)
    assert type(loaded[-1]) is base.SideCache and loaded[-1].offset == PROMPT.shape[1]
    assert all(mx.array_equal(a, b) for a, b in zip(caches[-1].state, loaded[-1].state))
    with velox_core.routed(model):
        a = _run(model, caches, steps=(7,))[1:]
        b = _run(model, loaded, steps=(7,))[1:]
    assert mx.array_equal(a, b)
    rows = velox_core.inspect_cache_file(path)["layers"]
    assert rows[-1]["method"] == "toyvl.SideCache" and rows[-1]["tokens"] == PROMPT.shape[1]


def test_save_refuses_a_class_no_host_lists(host, model, tmp_path):
    class Stray(base.KVCache):
        pass

    caches = velox_core.make_cache(model, "uniform:bits=8")
    caches[-1] = Stray()
    with pytest.raises(ValueError, match="cache class Stray is not supported"):
        velox_core.save_cache(tmp_path / "x.safetensors", caches)


def test_load_refuses_a_host_or_class_it_does_not_know(host, model, tmp_path, monkeypatch):
    caches = velox_core.make_cache(model, "uniform:bits=8")
    with velox_core.routed(model):
        model(PROMPT[:, :8], cache=caches)
    path = tmp_path / "toy.safetensors"
    velox_core.save_cache(path, caches)
    # the host's allow-list no longer holds SideCache
    monkeypatch.setitem(
        H._hosts,
        "toyvl",
        Host(**{**vars(host), "saved_classes": lambda: {"KVCache": base.KVCache}}),
    )
    with pytest.raises(ValueError, match="unsupported class 'SideCache' of host 'toyvl'"):
        velox_core.load_cache(path)
    # no such host registered (its package not installed)
    del H._hosts["toyvl"]
    monkeypatch.setattr(H, "_loaded", True)
    with pytest.raises(ValueError, match="unknown host 'toyvl'"):
        velox_core.load_cache(path)


def test_add_host_refusals(monkeypatch):
    monkeypatch.setattr(H, "_hosts", dict(H._hosts))
    monkeypatch.setattr(H, "_loaded", H._loaded)
    with pytest.raises(TypeError, match="expected a velox_core Host, got dict"):
        add_host({"name": "x"})
    with pytest.raises(ValueError, match="'mlx_lm' is velox-core's own host"):
        add_host(_toy_host("mlx_lm"))


class _EP:
    def __init__(self, name, obj):
        self.name, self.value, self._obj = name, f"pkg:{name}", obj

    def load(self):
        if isinstance(self._obj, Exception):
            raise self._obj
        return self._obj


def test_entry_points_are_read_on_first_need_and_a_broken_one_is_skipped(monkeypatch, model):
    monkeypatch.setattr(H, "_hosts", {MLX_LM.name: MLX_LM})
    monkeypatch.setattr(H, "_loaded", False)
    eps = [
        _EP("broken", ImportError("no module named toyvl_velox")),
        _EP("wrong", lambda: "not a host"),
        _EP("toyvl", _toy_host),  # a function returning the host
    ]
    monkeypatch.setattr(H, "entry_points", lambda group: eps if group == H.GROUP else [])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        found = host_of(model)
    assert found.name == "toyvl"
    messages = [str(w.message) for w in caught]
    assert any("skipping host plugin 'broken'" in m for m in messages), messages
    assert any("skipping host plugin 'wrong'" in m and "gives a str" in m for m in messages)
    assert sorted(H.hosts()) == ["mlx_lm", "toyvl"]
    with pytest.raises(ValueError, match="unknown host 'nope'.*installed hosts: mlx_lm, toyvl"):
        get_host("nope")


def _nan_first(a):
    return mx.where(mx.arange(a.size).reshape(a.shape) == 0, float("nan"), a)


# a host layer's header or arrays altered and the file signed again (as tests/test_io_crafted.py
# does for mlx-lm's and velox's layers): refused before the host's class is built from them
HOST_CASES = [
    ("a NaN key", lambda layer, arrays, k, v: arrays.update({k: _nan_first(arrays[k])}), "NaN"),
    (
        "integer keys",
        lambda layer, arrays, k, v: arrays.update({k: arrays[k].astype(mx.int32)}),
        "floating",
    ),
    (
        "values of fewer tokens",
        lambda layer, arrays, k, v: arrays.update({v: arrays[v][:, :, :3]}),
        "differ in batch, heads or tokens",
    ),
    (
        "keys of three dims",
        lambda layer, arrays, k, v: arrays.update({k: arrays[k][0]}),
        "floating \\(batch, heads, tokens, dim\\)",
    ),
    (
        "a negative number item",
        lambda layer, arrays, k, v: (
            layer["items"].append({"type": "number", "value": -4}),
            layer["nested"].append(0),
        ),
        "state number = -4",
    ),
    ("a meta_state of numbers", lambda layer, arrays, k, v: layer.update(meta=[1, 2]), "meta"),
]


@pytest.mark.parametrize("case", HOST_CASES, ids=[c[0] for c in HOST_CASES])
def test_load_refuses_a_crafted_host_layer(host, model, tmp_path, case):
    import json

    from velox_core.io import _digest

    _, edit, message = case
    caches = velox_core.make_cache(model, "uniform:bits=8")
    with velox_core.routed(model):
        model(PROMPT[:, :8], cache=caches)
    path = tmp_path / "toy.safetensors"
    velox_core.save_cache(path, caches)
    arrays, header = mx.load(str(path), return_metadata=True)
    layers = json.loads(header["layers"])
    last = layers[-1]
    assert last["kind"] == "host"
    k, v = (it["name"] for it in last["items"] if it["type"] == "array")
    edit(last, arrays, k, v)
    header["layers"] = json.dumps(layers)
    header["sha256"] = _digest(arrays, header)
    crafted = tmp_path / "crafted.safetensors"
    mx.save_safetensors(str(crafted), arrays, header)
    with pytest.raises(ValueError, match=f"layer {len(layers) - 1}.*{message}"):
        velox_core.load_cache(crafted)


def test_zz_the_registry_is_left_as_found():
    """Run last in this file: once the entry points count as read, every host they give is
    registered (the tests above restore the registry whole; mlx-vlm's models, in the same
    process, must still find their host)."""
    if not H._loaded:
        return
    for ep in H.entry_points(group=H.GROUP):
        try:
            obj = ep.load()
            found = obj if isinstance(obj, Host) else obj()
        except Exception:
            continue  # a broken plugin is skipped (test above)
        assert isinstance(found, Host) and found.name in H._hosts, ep.name
