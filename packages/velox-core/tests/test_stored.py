"""velox_core.stored.StoredTokens: a model's caches read as their tokens and rebuilt around
other tokens, and the records of a file checked before anything is decoded."""

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import KVCache, RotatingKVCache

from velox_core import make_cache, routed
from velox_core.stored import StoredTokens
from velox_testing import conformance_model


def _prefilled(spec=None, tokens=40):
    m = conformance_model(head_dim=32)
    caches = [KVCache() for _ in m.layers] if spec is None else make_cache(m, spec)
    with routed(m):
        m(mx.array(np.random.default_rng(0).integers(0, 512, (1, tokens))), cache=caches)
    return m, caches


@pytest.mark.parametrize("spec", [None, "uniform:bits=8,group=32"])
def test_read_then_build_gives_caches_of_the_same_classes_that_decode(spec):
    m, caches = _prefilled(spec)
    t = StoredTokens.read(caches, "test")
    assert [x["kind"] for x in t.layers] == ["mlx_lm" if spec is None else "velox"] * 2
    assert t.kv[0][0].shape == (1, 2, 40, 32)
    for model in (m, None):
        back = StoredTokens(t.kv, StoredTokens.check_records(t.layers, "bad")).build(model)
        assert [type(c) for c in back] == [type(c) for c in caches]
        assert all(c.offset == 40 for c in back)
        again = StoredTokens.read(back, "test")
        for (k, v), (k2, v2) in zip(t.kv, again.kv):
            if spec is None:  # mlx-lm keeps the tokens as they are
                assert bool(mx.array_equal(k, k2)) and bool(mx.array_equal(v, v2))
        with routed(m):
            assert bool(mx.all(mx.isfinite(m(mx.array([[3]]), cache=back))))


def test_what_read_and_check_refuse():
    with pytest.raises(ValueError, match="who: caches must be a non-empty list"):
        StoredTokens.read([], "who")
    with pytest.raises(ValueError, match="who: layer 0 holds a RotatingKVCache"):
        StoredTokens.read([RotatingKVCache(max_size=4)], "who")
    with pytest.raises(ValueError, match="who: layer 0's cache is empty"):
        StoredTokens.read([KVCache()], "who")
    good = {"kind": "mlx_lm", "class": "KVCache", "dtype": "float16"}
    for bad, match in [
        ([], "layers must be a non-empty list"),
        ([1], "layer 0 is not an object"),
        ([{**good, "kind": "pickle"}], "unknown kind 'pickle'"),
        ([{**good, "dtype": "int8"}], "dtype 'int8'"),
        ([{**good, "class": "QuantizedKVCache"}], "not an mlx-lm KVCache record"),
        ([{"kind": "velox", "method": "x"}], "not a velox cache record"),
    ]:
        with pytest.raises(ValueError, match=match):
            StoredTokens.check_records(bad, "corrupt header")
    velox = {
        "kind": "velox",
        "method": "no-such-method",
        "config": {},
        "dtype": "float16",
        "io_dtype": "float16",
        "storage_dtype": None,
    }
    kv = [(mx.zeros((1, 2, 4, 32)), mx.zeros((1, 2, 4, 32)))]
    with pytest.raises(ValueError, match="unknown method .no-such-method."):
        StoredTokens(kv, StoredTokens.check_records([velox], "h")).build(None, "who")
