"""Saving and loading, the registry and method specs."""

import json

import mlx.core as mx
import pytest
from mlx_lm.models.cache import KVCache, RotatingKVCache

from velox_core import (
    UniformCache,
    VeloxCache,
    get_method,
    inspect_cache_file,
    load_cache,
    make,
    methods,
    parse_spec,
    save_cache,
)
from velox_core.io import _digest
from velox_core.registry import method_params
from velox_testing import kv_data
from velox_testing.models import spec_text


def test_spec_parsing():
    assert parse_spec("uniform") == ("uniform", {})
    assert parse_spec("uniform:bits=4,group=64") == ("uniform", {"bits": 4, "group": 64})
    assert parse_spec("turboquant:bits=3.5") == ("turboquant", {"bits": 3.5})
    assert parse_spec("x:a=true,b=none,c=token") == ("x", {"a": True, "b": None, "c": "token"})
    assert spec_text("uniform", {"bits": 4}) == "uniform:bits=4"
    assert parse_spec(spec_text("x", {"a": 1, "b": "token"})) == ("x", {"a": 1, "b": "token"})
    for bad in ("", "uniform:bits", "uniform:=4"):
        with pytest.raises(ValueError):
            parse_spec(bad)
    with pytest.raises(ValueError, match="'bits' is given twice"):  # the last one won, silently
        parse_spec("uniform:bits=4,bits=2")
    # a composed spec (velox bench's A+B) read "bits must be an int, got str '4+uniform:...'"
    with pytest.raises(ValueError, match="composes two specs"):
        make("uniform:bits=4+uniform:bits=8")


def test_registry_finds_uniform_through_entry_points():
    assert "uniform" in methods()
    m = get_method("uniform")
    assert m.cache_class is UniformCache
    assert method_params("uniform")["bits"] == 4
    c = make("uniform:bits=2,window=8")
    assert isinstance(c, UniformCache) and c.config()["bits"] == 2 and c.window == 8
    with pytest.raises(ValueError, match="no parameter 'bitz'.*allowed: bits"):
        make("uniform:bitz=2")
    with pytest.raises(ValueError, match="unknown method 'nope'"):
        get_method("nope")


def test_broken_plugin_is_skipped_with_a_warning(monkeypatch):
    import velox_core.registry as reg

    class EP:
        name, value, group = "broken", "no_such_module:METHOD", reg.GROUP

        def load(self):
            raise ImportError("no module named no_such_module")

    real = reg.entry_points

    def fake(group):
        return [*real(group=group), EP()]

    monkeypatch.setattr(reg, "entry_points", fake)
    reg.reset()
    try:
        with pytest.warns(RuntimeWarning, match="broken"):
            ms = reg.methods()
        assert "uniform" in ms and "broken" not in ms
    finally:
        reg.reset()


def _filled(cache, t=100):
    k, v = kv_data(t=t)
    cache.update_and_fetch(k, v)
    return cache


def test_save_load_mixed_layers(tmp_path):
    rot = RotatingKVCache(max_size=32)
    k, v = kv_data(t=40)
    rot.update_and_fetch(k, v)
    caches = [
        _filled(UniformCache(bits=4, window=8)),
        _filled(KVCache()),
        rot,
        _filled(VeloxCache(window=4, sinks=2)),
    ]
    path = tmp_path / "c.safetensors"
    save_cache(path, caches)
    out = load_cache(path)
    assert [type(c) for c in out] == [UniformCache, KVCache, RotatingKVCache, VeloxCache]
    q = mx.random.normal((1, 4, 1, 128)).astype(mx.float16)
    for a, b in ((out[0], caches[0]), (out[3], caches[3])):  # equal to fp16 rounding
        assert mx.allclose(a.attend(q, 0.1), b.attend(q, 0.1), rtol=2e-3, atol=1e-4).item()
    assert out[2].offset == 40 and out[2].max_size == 32
    info = inspect_cache_file(path)
    assert [r["method"] for r in info["layers"]] == [
        "uniform",
        "KVCache",
        "RotatingKVCache",
        "velox",
    ]
    assert info["layers"][0]["tokens"] == 100
    assert info["bytes"] == sum(r["bytes"] for r in info["layers"])


def test_load_rejects_foreign_altered_and_unknown(tmp_path):
    path = tmp_path / "c.safetensors"
    save_cache(path, [_filled(UniformCache(bits=4))])
    foreign = tmp_path / "foreign.safetensors"
    mx.save_safetensors(str(foreign), {"a": mx.zeros((2,))}, {"format": "pt"})
    with pytest.raises(ValueError, match="not a velox cache"):
        load_cache(foreign)
    junk = tmp_path / "junk.safetensors"
    junk.write_bytes(b"\x00" * 40)
    with pytest.raises(ValueError, match="not a readable"):
        load_cache(junk)
    with pytest.raises(ValueError, match="no such file"):
        load_cache(tmp_path / "missing.safetensors")
    # a header that names a method nobody registered
    arrays, header = mx.load(str(path), return_metadata=True)
    layers = json.loads(header["layers"])
    layers[0]["method"] = layers[0]["meta"]["method"] = "evil"
    header["layers"] = json.dumps(layers)
    other = tmp_path / "other.safetensors"
    mx.save_safetensors(str(other), arrays, header)
    with pytest.raises(ValueError, match="checksum"):  # the header is signed
        load_cache(other)
    header["sha256"] = _digest(arrays, header)  # signed again by hand
    mx.save_safetensors(str(other), arrays, header)
    with pytest.raises(ValueError, match="unknown method 'evil'"):
        load_cache(other)
    # data altered behind an intact header
    arrays, header = mx.load(str(path), return_metadata=True)
    name = next(iter(arrays))
    arrays[name] = arrays[name] + 1
    mx.save_safetensors(str(other), arrays, header)
    with pytest.raises(ValueError, match="checksum"):
        load_cache(other)


def _resigned(path, tmp_path, edit):
    """A copy of the file whose header ``edit`` changed, signed again (a consistent file
    that a careful writer would never produce)."""
    arrays, header = mx.load(str(path), return_metadata=True)
    layers = json.loads(header["layers"])
    edit(header, layers)
    header["layers"] = json.dumps(layers)
    header["sha256"] = _digest(arrays, header)
    out = tmp_path / "edited.safetensors"
    mx.save_safetensors(str(out), arrays, header)
    return out


def test_header_is_checked_and_counts_are_consistent(tmp_path):
    """One flipped byte in the header fails the checksum; a negative offset, a layer
    dropped (against n_layers, or against the model) and an unknown kind are refused, by
    load_cache and inspect_cache_file alike."""
    from velox_testing import tiny_model

    model = tiny_model("llama")
    caches = [_filled(UniformCache(bits=4)) for _ in model.layers]
    path = tmp_path / "c.safetensors"
    save_cache(path, caches)
    assert len(load_cache(path, model=model)) == len(model.layers)
    raw = bytearray(path.read_bytes())
    at = raw.index(b"offset")
    raw[at] = ord("O")  # inside the JSON header, not the arrays
    flipped = tmp_path / "flipped.safetensors"
    flipped.write_bytes(bytes(raw))
    for f in (load_cache, inspect_cache_file):
        with pytest.raises(ValueError, match="checksum"):
            f(flipped)

    def negative(header, layers):
        layers[0]["meta"]["offset"] = -5

    def dropped(header, layers):
        del layers[-1]

    def pickled(header, layers):
        layers[0] = {"kind": "pickle", "data": "..."}

    cases = ((negative, "offset = -5"), (dropped, "corrupt layer header"), (pickled, "kind"))
    for edit, msg in cases:
        bad = _resigned(path, tmp_path, edit)
        for f in (load_cache, inspect_cache_file):
            with pytest.raises(ValueError, match=msg):
                f(bad)

    def dropped_consistently(header, layers):
        del layers[-1]
        header["n_layers"] = str(len(layers))

    short = _resigned(path, tmp_path, dropped_consistently)
    assert len(load_cache(short)) == len(model.layers) - 1
    with pytest.raises(ValueError, match="for a model of"):
        load_cache(short, model=model)


def test_save_rejects_bad_input(tmp_path):
    with pytest.raises(ValueError):
        save_cache(tmp_path / "x.safetensors", [])
    with pytest.raises(ValueError, match="safetensors"):
        save_cache(tmp_path / "x.bin", [_filled(UniformCache())])
    with pytest.raises(ValueError, match="not supported"):
        save_cache(tmp_path / "x.safetensors", [object()])


# -- per-model artifacts ---------------------------------------------------------------------------
def test_artifacts_fingerprint_and_resolution(tmp_path, monkeypatch):
    import dataclasses

    import mlx.core as mx
    import pytest

    from velox_core import artifacts
    from velox_testing import tiny_model

    model, other = tiny_model("llama"), tiny_model("llama", seed=1)
    fp = artifacts.fingerprint(model)
    assert fp != artifacts.fingerprint(other)
    model.set_dtype(mx.bfloat16)  # a cast keeps the fingerprint
    assert artifacts.fingerprint(model) == fp

    def write(name, fmt="velox-test", version="1", fingerprint=fp):
        path = tmp_path / name
        meta = {"format": fmt, "version": version, "fingerprint": fingerprint}
        mx.save_safetensors(str(path), {"w": mx.zeros((2,))}, meta)
        return path

    kind = artifacts.ArtifactKind("velox-test", "1", "Test", param="art", how_to_fit="fit-it")
    monkeypatch.setenv(artifacts.ENV, str(tmp_path))
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    with pytest.raises(LookupError, match="no Test artifact .*fit-it.*art=FILE"):
        dataclasses.replace(kind, missing=LookupError).resolve(model)
    foreign = write("a.safetensors", fingerprint=artifacts.fingerprint(other))
    wrong = write("b.safetensors", fmt="velox-other")
    old = write("c.safetensors", version="0")
    mine = write("d.safetensors")
    assert kind.resolve(model) == mine  # found by fingerprint
    assert kind.resolve(model, mine) == mine
    with pytest.raises(ValueError, match="art=.* was fitted for another model"):
        kind.resolve(model, foreign)
    with pytest.raises(ValueError, match="not a Test artifact"):
        kind.resolve(model, wrong)
    with pytest.raises(ValueError, match="unsupported Test artifact version"):
        kind.resolve(model, old)
    with pytest.raises(ValueError, match="no such file"):
        kind.resolve(model, tmp_path / "none.safetensors")
    (tmp_path / "junk.safetensors").write_bytes(b"junk")
    with pytest.raises(ValueError, match="not a safetensors file"):
        artifacts.read_metadata(tmp_path / "junk.safetensors")
    calls = []
    load = lambda p: calls.append(p) or len(calls)  # noqa: E731
    assert artifacts.load_cached(load, mine) == artifacts.load_cached(load, mine) == 1
