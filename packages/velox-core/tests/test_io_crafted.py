"""Crafted cache files (issue 55): headers altered and the checksum signed again. Each is
refused by ``load_cache`` with a ``ValueError`` naming the layer and the field, never loaded
with a header that contradicts its arrays, never a raw ``KeyError``/``TypeError`` text, and
fast whatever a count in the header says (``tools/bad_input_sweep.py`` runs the full sweep)."""

import json
import time

import mlx.core as mx
import pytest
from mlx_lm.models.cache import KVCache, QuantizedKVCache

from velox_core import RetentionPolicy, Uniform, UniformCache, VeloxCache, load_cache, save_cache
from velox_core.io import _digest
from velox_testing import kv_data


def _saved(tmp_path, kind: str):
    k, v = kv_data(t=100)
    if kind == "uniform":
        c = UniformCache(bits=4, window=8)
    elif kind == "policy":
        c = VeloxCache(Uniform(4), Uniform(4), sinks=2, window=8, policy=RetentionPolicy(budget=64))
    elif kind == "kv":
        c = KVCache()
    else:
        c = QuantizedKVCache(group_size=64, bits=4)
    c.update_and_fetch(k.astype(mx.float16), v.astype(mx.float16))
    path = tmp_path / f"{kind}.safetensors"
    save_cache(path, [c])
    return path


def _crafted(path, tmp_path, edit):
    arrays, header = mx.load(str(path), return_metadata=True)
    layers = json.loads(header["layers"])
    edit(layers[0], arrays)
    header["layers"] = json.dumps(layers)
    header["sha256"] = _digest(arrays, header)
    out = tmp_path / "crafted.safetensors"
    mx.save_safetensors(str(out), arrays, header)
    return out


def _meta(**changes):
    return lambda layer, arrays: layer["meta"].update(changes)


def _first_store(**changes):
    return lambda layer, arrays: next(iter(layer["meta"]["stores"].values())).update(changes)


def _nan(name):
    def edit(layer, arrays):
        key = next(k for k in arrays if k.endswith(name))
        a = arrays[key]
        arrays[key] = mx.where(mx.arange(a.size).reshape(a.shape) == 0, float("nan"), a)

    return edit


def _bits(layer, arrays):
    layer["meta"]["config"]["bits"] = 2  # the arrays hold 4-bit codes


def _item(i, value):
    def edit(layer, arrays):
        nums = [it for it in layer["items"] if it["type"] == "number"]
        nums[i]["value"] = value

    return edit


CASES = [
    ("uniform", "offset 10**15", _meta(offset=10**15), "meta.offset"),
    ("uniform", "offset below the tokens", _meta(offset=50), "offset"),
    ("uniform", "offset a string", _meta(offset="100"), "meta.offset"),
    ("uniform", "ragged 10**8", _meta(ragged=10**8), "meta.ragged"),
    ("uniform", "dims of another head dim", _meta(dims=[1, 2, 64, 128]), "dims"),
    ("uniform", "dtype int32", _meta(dtype="int32"), "meta.dtype"),
    ("uniform", "bits 2 over 4-bit codes", _bits, "codes"),
    ("uniform", "a NaN scale", _nan(".scale"), "NaN"),
    ("uniform", "window block 3", _first_store(block=3), "block"),
    ("uniform", "a store past its rows", _first_store(tokens=9), "rows"),
    ("uniform", "arrays list cut", lambda l, a: l["meta"].update(arrays=[]), "meta.arrays"),
    ("uniform", "a store the method does not read", _meta(stores={"evil.k": {}}), "stores"),
    ("policy", "policy meta junk", _meta(policy_meta={"window": "x"}), "policy_meta"),
    ("policy", "a position past the offset", _meta(offset=60), "offset"),
    ("kv", "offset past the tokens", _item(0, 300), "offset"),
    ("kv", "offset negative", _item(0, -1), "offset"),
    ("q4", "bits 8 over 4-bit codes", _item(2, 8), "bits"),
    ("q4", "group 32 over group-64 scales", _item(1, 32), "group"),
    ("q4", "a NaN bias", _nan("layer0.5"), "NaN"),
]


@pytest.mark.parametrize("kind,what,edit,field", CASES, ids=[c[1] for c in CASES])
def test_a_crafted_header_is_refused_naming_the_field(tmp_path, kind, what, edit, field):
    bad = _crafted(_saved(tmp_path, kind), tmp_path, edit)
    t0 = time.perf_counter()
    with pytest.raises(ValueError) as e:
        load_cache(bad)
    assert time.perf_counter() - t0 < 10  # ragged=10**8 allocated stores for minutes
    text = str(e.value)
    assert "layer 0" in text and field in text, text
    for raw in ("KeyError", "TypeError", "IndexError"):
        assert raw not in text, text


def test_every_kind_saved_here_loads_again(tmp_path):
    """The checks refuse no file save_cache writes (each kind above, unaltered)."""
    for kind in ("uniform", "policy", "kv", "q4"):
        (cache,) = load_cache(_saved(tmp_path, kind))
        assert cache.offset == 100
