"""velox-transfer: fitting, saving, loading, applying and refusing mappers between tiny models."""

from __future__ import annotations

import hashlib
import json

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import KVCache, RotatingKVCache

from velox_core import VeloxCache, make_cache, routed
from velox_testing import tiny_model
from velox_transfer import (
    Mapper,
    MapperError,
    evaluate,
    fit_mapper,
    load_mapper,
    transfer_cache,
)
from velox_transfer.data import split
from velox_transfer.fit import lagged, model_rows
from velox_transfer.mapper import _manifest_sha
from velox_transfer.spec import ModelSpec

F32 = mx.float32


def _llama(seed: int = 0, **overrides):
    """A tiny float32 llama of ``seed`` (``velox_testing.tiny_model``), its config changed
    by ``overrides``."""
    return tiny_model("llama", seed=seed, dtype=F32, **overrides)


def _seqs(n: int, t: int, seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 512, t).astype(np.int32) for _ in range(n)]


def _prefill(model, tokens) -> tuple[list, mx.array]:
    caches = [KVCache() for _ in model.layers]
    logits = model(mx.array(np.asarray(tokens, dtype=np.int32))[None], cache=caches)[:, -1]
    mx.eval(logits)
    return caches, logits


@pytest.fixture(scope="module")
def same():
    """A model and itself: every target layer is exactly its own source layer (chosen by
    the greedy selection, one source layer each; no lags: with 288 fit rows, four lags'
    features would outnumber them)."""
    m = _llama()
    return m, fit_mapper(m, m, _seqs(3, 96, 1), _seqs(1, 96, 2), layers_per_target=1, lags=(0,))


@pytest.fixture(scope="module")
def pair():
    """Two unrelated models of different geometries (3 layers, 1 KV head of 32 channels)."""
    src = _llama()
    tgt = _llama(
        1,
        hidden_size=96,
        num_hidden_layers=3,
        num_attention_heads=3,
        num_key_value_heads=1,
        head_dim=32,
        rope_theta=1e5,
    )
    held = _seqs(2, 96, 4)
    mapper = fit_mapper(src, tgt, _seqs(6, 96, 3), held, layers_per_target=2, lags=(0, 2))
    return src, tgt, mapper, held


def test_self_transfer_is_exact(same):
    m, mapper = same
    assert [mapper.sources(i) for i in range(2)] == [(0,), (1,)]
    assert all(mapper.lags(i) == (0,) for i in range(2))
    assert all(r["r2_key"] > 0.999 and r["r2_value"] > 0.999 for r in mapper.info)
    toks = _seqs(1, 40, 5)[0]
    ref, ref_logits = _prefill(m, toks)
    src, _ = _prefill(m, toks[:-1])
    caches = transfer_cache(src, mapper, "fp16", model=m, source_model=m, dtype=F32, chunk=16)
    assert [c.offset for c in caches] == [39, 39]
    for c, r in zip(caches, ref):
        k, v = c.keys_and_values()
        rk, rv = r.keys_and_values()
        np.testing.assert_allclose(np.array(k), np.array(rk[:, :, :39]), atol=2e-3, rtol=1e-3)
        np.testing.assert_allclose(np.array(v), np.array(rv[:, :, :39]), atol=2e-3, rtol=1e-3)
    logits = m(mx.array(toks[-1:])[None], cache=caches)[:, -1]
    np.testing.assert_allclose(np.array(logits), np.array(ref_logits), atol=2e-2, rtol=1e-2)


def test_rope_of_each_model_is_used():
    """Same weights, another RoPE base and layout: layer 0's content is identical, so its
    mapped keys must be the target's own keys, rotated at the target's frequencies."""
    src = _llama(rope_theta=1e4)
    tgt = _llama(rope_theta=1e6, rope_traditional=True)
    mapper = fit_mapper(src, tgt, _seqs(3, 96, 6), _seqs(1, 96, 7), layers_per_target=1, lags=(0,))
    assert mapper.sources(0) == (0,) and mapper.info[0]["r2_key"] > 0.999
    toks = _seqs(1, 48, 8)[0]
    ref, _ = _prefill(tgt, toks)
    src_c, _ = _prefill(src, toks)
    out = transfer_cache(src_c, mapper, model=tgt, dtype=F32)
    np.testing.assert_allclose(
        np.array(out[0].keys_and_values()[0]),
        np.array(ref[0].keys_and_values()[0]),
        atol=2e-3,
        rtol=1e-3,
    )


def test_heldout_r2_matches_direct_computation(pair):
    """The manifest's R², computed from second moments, equals the R² of the saved weights
    applied to the held-out rows directly."""
    src, tgt, mapper, held = pair
    _check_heldout_r2(src, tgt, mapper, held)


def _check_heldout_r2(src, tgt, mapper, held):
    ss, ts = ModelSpec.of(src), ModelSpec.of(tgt)
    x = np.concatenate([model_rows(src, ss, s) for s in held])
    y = np.concatenate([model_rows(tgt, ts, s) for s in held])
    xo = np.cumsum([0] + [ls.features for ls in ss.layers])
    yo = np.cumsum([0] + [ls.features for ls in ts.layers])
    for i, ls in enumerate(ts.layers):
        m = mapper.layer(i)
        assert m.lags == (0, 2) and m.u.shape[0] == 2 * sum(
            ss.layers[j].features for j in m.sources
        )
        xi = np.concatenate(  # lag-major, then source layer; lags within each sequence
            [
                np.concatenate(
                    [lagged(r[:, xo[j] : xo[j + 1]], (lag,)) for lag in m.lags for j in m.sources],
                    axis=1,
                )
                for r in np.split(x, len(held))
            ]
        )
        yi = y[:, yo[i] : yo[i + 1]]
        pred = xi @ np.array(m.u) @ np.array(m.v) + np.array(m.b)
        nk = ls.kv_heads * ls.key_dim
        for cols, name in ((slice(0, nk), "r2_key"), (slice(nk, None), "r2_value")):
            sse = ((yi[:, cols] - pred[:, cols]) ** 2).sum()
            sst = ((yi[:, cols] - yi[:, cols].mean(0)) ** 2).sum()
            assert mapper.info[i][name] == pytest.approx(1 - sse / sst, abs=2e-3)
        assert len(m.sources) <= 2


def test_save_load_apply_fp16_and_codec(pair, tmp_path):
    src, tgt, mapper, _ = pair
    mapper.save(tmp_path / "m")
    loaded = load_mapper(tmp_path / "m", source=src, target=tgt)
    assert loaded._layers == {}  # read lazily, layer by layer
    toks = _seqs(1, 70, 9)[0]
    src_c, _ = _prefill(src, toks)
    a = transfer_cache(src_c, mapper, model=tgt, dtype=F32)
    b = transfer_cache(src_c, loaded, model=tgt, dtype=F32, chunk=32)
    for x, y in zip(a, b):
        np.testing.assert_allclose(
            np.array(x.keys_and_values()[0]), np.array(y.keys_and_values()[0]), atol=1e-4
        )
    # a velox source cache (8-bit codes) maps to nearly the same target cache
    vsrc = make_cache(src, "uniform:bits=8")
    src(mx.array(toks)[None], cache=vsrc)
    c = transfer_cache(vsrc, loaded, model=tgt, dtype=F32)
    np.testing.assert_allclose(
        np.array(c[1].keys_and_values()[0]), np.array(a[1].keys_and_values()[0]), atol=0.1
    )
    coded = transfer_cache(src_c, loaded, "uniform:bits=4,group=32,window=0", model=tgt, tokens=64)
    assert all(isinstance(c, VeloxCache) and c.offset == 64 for c in coded)
    fp16 = transfer_cache(src_c, loaded, model=tgt, tokens=64)
    assert sum(c.nbytes for c in coded) < sum(c.nbytes for c in fp16)
    with routed(tgt):  # decode from the codes
        logits = tgt(mx.array(toks[64:])[None], cache=coded)[:, -1]
        ref = tgt(mx.array(toks[64:])[None], cache=fp16)[:, -1]
    p, q = mx.softmax(ref, -1), mx.softmax(logits, -1)
    assert float(mx.sum(p * (mx.log(p) - mx.log(q)))) < 0.1


def test_apply_matches_the_fitted_regression_across_chunks(pair):
    """``transfer_cache``'s values (no RoPE on them) are the regression applied to the lagged
    source rows, at any chunk size (lags reach into the previous chunk), and its keys are
    the same regression's keys with the target's RoPE."""
    src, tgt, mapper, _ = pair
    ss, ts = ModelSpec.of(src), ModelSpec.of(tgt)
    toks = _seqs(1, 50, 12)[0]
    x = model_rows(src, ss, toks)
    xo = np.cumsum([0] + [ls.features for ls in ss.layers])
    src_c, _ = _prefill(src, toks)
    whole = transfer_cache(src_c, mapper, model=tgt, dtype=F32, chunk=1000)
    bits = transfer_cache(src_c, mapper, model=tgt, dtype=F32, chunk=3)
    for i, ls in enumerate(ts.layers):
        m = mapper.layer(i)
        xi = np.concatenate(
            [lagged(x[:, xo[j] : xo[j + 1]], (lag,)) for lag in m.lags for j in m.sources], axis=1
        )
        pred = xi @ np.array(m.u) @ np.array(m.v) + np.array(m.b)
        nk = ls.kv_heads * ls.key_dim
        v_pred = pred[:, nk:].reshape(50, ls.kv_heads, ls.value_dim).transpose(1, 0, 2)
        for out in (whole, bits):
            v = out[i].keys_and_values()[1]
            np.testing.assert_allclose(np.array(v[0]), v_pred, atol=2e-3, rtol=1e-3)
        np.testing.assert_allclose(
            np.array(bits[i].keys_and_values()[0]),
            np.array(whole[i].keys_and_values()[0]),
            atol=2e-3,
            rtol=1e-3,
        )


def test_evaluate_rows(same):
    m, mapper = same
    stream = _seqs(1, 400, 10)[0]
    rows = evaluate(m, m, mapper, stream, (48,), continuation=4, samples=2, tails=(8,))
    by = {r.way: r for r in rows}
    assert set(by) == {
        "target prefill",
        "transfer",
        "transfer + last 8",
        "empty cache",
        "last 8 only",
    }
    assert by["transfer"].kl < 1e-3 and by["transfer"].top1 == 1.0
    assert by["empty cache"].kl > 100 * max(by["transfer"].kl, 1e-6)


def _corrupt(path, name, fn):
    p = path / name
    p.write_bytes(fn(p.read_bytes()))


def test_refusals(pair, tmp_path):
    src, tgt, mapper, _ = pair
    root = mapper.save(tmp_path / "m")
    with pytest.raises(MapperError, match="fingerprint"):
        load_mapper(root, source=tgt)  # a foreign source model
    other = _llama(7)
    src_c, _ = _prefill(src, _seqs(1, 20, 11)[0])
    with pytest.raises(MapperError, match="fitted for a target"):
        transfer_cache(src_c, mapper, model=other)
    with pytest.raises(ValueError, match="expected a list of 2"):
        transfer_cache(src_c[:1], mapper)
    with pytest.raises(TypeError, match="RotatingKVCache"):
        transfer_cache([RotatingKVCache(64), src_c[1]], mapper)
    with pytest.raises(ValueError, match="tokens=21"):
        transfer_cache(src_c, mapper, tokens=21)
    # a truncated layer file: refused at load (size), an altered one at first use (SHA-256)
    _corrupt(root, "layer.1.safetensors", lambda b: b[:-8])
    with pytest.raises(MapperError, match="bytes"):
        load_mapper(root)
    root = mapper.save(tmp_path / "m")
    _corrupt(root, "layer.2.safetensors", lambda b: b[:-1] + bytes([b[-1] ^ 1]))
    m = load_mapper(root)
    m.layer(0)
    with pytest.raises(MapperError, match="truncated or altered"):
        transfer_cache(src_c, m)
    # a group's file (the shared projection): truncated at load, altered at first use
    _corrupt(root, "group.0.safetensors", lambda b: b[:-8])
    with pytest.raises(MapperError, match="group.0.safetensors has .* bytes"):
        load_mapper(root)
    root = mapper.save(tmp_path / "m")
    _corrupt(root, "group.0.safetensors", lambda b: b[:-1] + bytes([b[-1] ^ 1]))
    with pytest.raises(MapperError, match="group.0.safetensors.*truncated or altered"):
        load_mapper(root).layer(0)
    # an altered manifest, another version, not a mapper
    root = mapper.save(tmp_path / "m")
    man = json.loads((root / "manifest.json").read_text())
    man["groups"][0]["rank"] += 1
    (root / "manifest.json").write_text(json.dumps(man))
    with pytest.raises(MapperError, match="altered"):
        load_mapper(root)
    with pytest.raises(MapperError, match="no manifest.json"):
        load_mapper(tmp_path)
    # mappers of earlier versions (1: no lags; 2: one unfactorised w per layer), their
    # checksums intact
    for version in (1, 2):
        root = mapper.save(tmp_path / "m")
        man = json.loads((root / "manifest.json").read_text())
        man["version"] = version
        man["checksum"] = _manifest_sha(man)
        (root / "manifest.json").write_text(json.dumps(man))
        with pytest.raises(MapperError, match=f"version {version}.*reads version 3 only.*fit"):
            load_mapper(root)


def _rewrite(root, edit):
    """Apply ``edit`` to the manifest and sign it again (a consistent but wrong manifest)."""
    man = json.loads((root / "manifest.json").read_text())
    edit(man)
    man["checksum"] = _manifest_sha(man)
    (root / "manifest.json").write_text(json.dumps(man))


def test_inconsistent_manifests_refused(pair, tmp_path):
    """Manifests whose checksum is intact but whose records do not describe the files or a
    map of the two models: refused with what is wrong."""
    src, tgt, mapper, _ = pair
    root = mapper.save(tmp_path / "m")
    _rewrite(root, lambda m: m["layers"][1].update(group=len(m["groups"])))
    with pytest.raises(MapperError, match="corrupt mapper.*layer 1 is in group"):
        load_mapper(root)
    for edit, what in (
        (lambda m: m["groups"][0].update(sources=[7]), "source layers"),
        (lambda m: m["groups"][0].update(lags=[-1]), "lags"),
        (lambda m: m["groups"][0].update(rank=0), "rank"),
        (lambda m: m["groups"][0]["layers"].append(m["groups"][0]["layers"][0]), "target layers"),
        (lambda m: m.update(weights_dtype="int8"), "weights dtype"),
    ):
        root = mapper.save(tmp_path / "m")
        _rewrite(root, edit)
        with pytest.raises(MapperError, match=f"corrupt mapper.*{what}"):
            load_mapper(root)
    # a layer file whose v is stored in another dtype than the manifest's (its record signed
    # again): refused at first use, naming the array and both dtypes
    root = mapper.save(tmp_path / "m")
    m0 = mapper.layer(0)
    mx.save_safetensors(str(root / "layer.0.safetensors"), {"v": m0.v, "b": m0.b})
    data = (root / "layer.0.safetensors").read_bytes()
    _rewrite(
        root,
        lambda m: m["layers"][0].update(bytes=len(data), sha256=hashlib.sha256(data).hexdigest()),
    )
    with pytest.raises(MapperError, match="v is mlx.core.float32.*says mlx.core.float16"):
        load_mapper(root, source=src, target=tgt).layer(0)


def test_factorised_maps(pair, tmp_path):
    """Target layers reading the same source layers share one projection ``u``; a given rank
    is kept (its manifest R² checked on the held-out rows directly); ``rank_tol=0``
    keeps the unfactorised map's R²; the weights are stored in float16 and ``nbytes`` counts
    them."""
    src, tgt, mapper, held = pair
    covered = sorted(i for g in mapper.groups for i in g["layers"])
    assert covered == list(range(len(mapper.target.layers)))
    for g, rec in enumerate(mapper.groups):
        us = {id(mapper.layer(i).u) for i in rec["layers"]}
        assert len(us) == 1 and all(mapper.group(i) == g for i in rec["layers"])
        assert mapper.layer(rec["layers"][0]).u.shape[1] == rec["rank"]
    root = mapper.save(tmp_path / "m")
    stored = 0
    for f in root.glob("*.safetensors"):
        for name, a in mx.load(str(f)).items():
            assert a.dtype == (mx.float32 if name == "b" else mx.float16)
            stored += a.nbytes
    assert mapper.nbytes() == stored
    low = fit_mapper(src, tgt, _seqs(6, 96, 3), held, layers_per_target=2, lags=(0, 2), rank=2)
    assert all(g["rank"] == 2 for g in low.groups)
    _check_heldout_r2(src, tgt, low, held)
    exact = fit_mapper(
        src, tgt, _seqs(6, 96, 3), held, layers_per_target=2, lags=(0, 2), rank_tol=0.0
    )
    for a, b, c in zip(low.info, exact.info, mapper.info):
        assert b["r2_key"] == pytest.approx(b["r2_key_full"], abs=2e-3)
        assert b["r2_value"] == pytest.approx(b["r2_value_full"], abs=2e-3)
        assert (a["r2_key_full"], a["r2_value_full"]) == (c["r2_key_full"], c["r2_value_full"])
    for bad, kw in (
        ("rank", {"rank": 0}),
        ("rank_tol", {"rank_tol": -0.5}),
        ("weights_dtype", {"weights_dtype": "int8"}),
    ):
        with pytest.raises(ValueError, match=bad):
            fit_mapper(src, src, _seqs(1, 32, 0), _seqs(1, 32, 1), **kw)


def test_unsupported_models_refused():
    base = _llama()
    ntk = _llama(rope_scaling={"type": "dynamic", "factor": 2.0}, max_position_embeddings=64)
    with pytest.raises(ValueError, match="layer 0.*RoPE"):
        fit_mapper(base, ntk, _seqs(1, 32, 0), _seqs(1, 32, 1))
    gemma = tiny_model("gemma3", seed=0, dtype=F32)  # sliding-window layers
    with pytest.raises(ValueError, match="RotatingKVCache"):
        fit_mapper(gemma, base, _seqs(1, 32, 0), _seqs(1, 32, 1))
    with pytest.raises(ValueError, match="layers_per_target"):
        fit_mapper(base, base, _seqs(1, 32, 0), _seqs(1, 32, 1), layers_per_target=0)
    for lags in ((), (0, 0), (-1,), (0.5,), "01"):
        with pytest.raises(ValueError, match="lags must be"):
            fit_mapper(base, base, _seqs(1, 32, 0), _seqs(1, 32, 1), lags=lags)
    with pytest.raises(ValueError, match="alphas must be"):
        fit_mapper(base, base, _seqs(1, 32, 0), _seqs(1, 32, 1), alphas=(1.0, 0.0))
    assert isinstance(Mapper, type)


def test_split_is_disjoint():
    parts = split(55, 5)
    sets = [set(v) for v in parts.values()]
    assert sum(map(len, sets)) == 55 and len(set().union(*sets)) == 55
    assert parts["eval"] == list(range(4, 55, 5))
    with pytest.raises(ValueError, match="every"):
        split(10, 1)
