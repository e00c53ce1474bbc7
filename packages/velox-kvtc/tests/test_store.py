"""KVTC caches saved and loaded: exactness where promised, error bounds, sizes, refusals."""

import json

import mlx.core as mx
import numpy as np
import pytest
from _kvtc_util import SINKS, WINDOW, basis, basis_file, model, prefilled, prompt, tmp
from mlx_lm.models.cache import KVCache, RotatingKVCache

import velox_kvtc as kt
from velox_core import make_cache, routed, save_cache
from velox_kvtc.codec import project
from velox_kvtc.container import pack, unpack
from velox_kvtc.features import read_caches, to_rows
from velox_kvtc.header import digest


def _kv(caches):
    return [c.keys_and_values() for c in caches]


def _sq(a, b) -> float:
    return float(mx.sum(mx.square(a.astype(mx.float32) - b.astype(mx.float32))))


def test_roundtrip_keeps_sinks_and_window_exact_and_the_rest_within_the_plan():
    b = basis()
    caches = prefilled(200)
    path = tmp("roundtrip.kvtc")
    kt.save(path, caches, basis=b, ratio=4, window=WINDOW)
    back = kt.load(path, basis=b)
    assert [type(c) for c in back] == [KVCache, KVCache]
    assert [c.offset for c in back] == [200, 200]
    for (k, v), (k2, v2) in zip(_kv(caches), _kv(back)):
        assert k2.dtype == mx.float16 and k2.shape == k.shape
        for a, a2 in ((k, k2), (v, v2)):
            assert bool(mx.array_equal(a[:, :, :SINKS], a2[:, :, :SINKS]))
            assert bool(mx.array_equal(a[:, :, -WINDOW:], a2[:, :, -WINDOW:]))
    # the body's error in content space is the plan's: about what the held-out calibration
    # rows predicted (random tokens both: same distribution), never far above it
    ropes = [b.ropes[i] for i in b.layers]
    for side, x, x2 in zip(
        ("key", "value"),
        to_rows(_kv(caches), ropes, SINKS, 200 - WINDOW),
        to_rows(_kv(back), ropes, SINKS, 200 - WINDOW),
    ):
        err = _sq(x, x2) / _sq(x, b.means[side][None])
        z = project(x, b.means[side], b.bases[side], b.bases[side].shape[1])
        kept = b.plan("4", side).components
        floor = float(mx.sum(z[:, kept:] ** 2)) / _sq(x, b.means[side][None])
        assert floor <= err < 0.25, (side, err, floor)


def test_a_higher_ratio_is_smaller_and_less_exact():
    caches = prefilled(240, seed=7)
    errs, sizes = [], []
    for ratio in (3, 4, 8):
        sizes.append(kt.save(tmp(f"r{ratio}.kvtc"), caches, basis=basis(), ratio=ratio).total)
        back = kt.load(tmp(f"r{ratio}.kvtc"), basis=basis())
        errs.append(sum(_sq(k, k2) for (k, _), (k2, _) in zip(_kv(caches), _kv(back))))
    assert sizes[0] > sizes[1] > sizes[2]
    assert errs[0] < errs[1] < errs[2]


def test_unrotating_and_rotating_again_gives_the_stored_keys():
    """RoPE removal is exact: rows of stored keys, turned back, are those keys."""
    from velox_kvtc.features import from_rows

    b = basis()
    kv = _kv(prefilled(100, dtype=mx.float32))
    ropes, geo = [b.ropes[i] for i in b.layers], [b.geometry[i] for i in b.layers]
    keys, values = to_rows(kv, ropes, 7, 93)
    for (k, v), (k2, v2) in zip(kv, from_rows(keys, values, geo, ropes, 1, 7)):
        assert float(mx.max(mx.abs(k2 - k[:, :, 7:93]))) <= 1e-5 * float(mx.max(mx.abs(k)))
        assert bool(mx.array_equal(v2, v[:, :, 7:93]))
        assert bool(mx.array_equal(k2.astype(mx.float16), k[:, :, 7:93].astype(mx.float16)))
    # and the un-rotated keys are not the stored ones (RoPE was undone, not skipped)
    assert float(mx.max(mx.abs(keys[:, :32] - kv[0][0][0, 0, 7:93]))) > 1e-2


def test_short_caches_are_kept_whole_and_batches_roundtrip():
    short = prefilled(SINKS + WINDOW - 3)
    kt.save(tmp("short.kvtc"), short, basis=basis(), ratio=4)
    for (k, v), (k2, v2) in zip(_kv(short), _kv(kt.load(tmp("short.kvtc"), basis=basis()))):
        assert bool(mx.array_equal(k, k2)) and bool(mx.array_equal(v, v2))
    two = prefilled(150, batch=2)
    kt.save(tmp("batch.kvtc"), two, basis=basis(), ratio=3)
    back = kt.load(tmp("batch.kvtc"), basis=basis())
    for (k, _), (k2, _) in zip(_kv(two), _kv(back)):
        assert k2.shape == k.shape == (2, 2, 150, 32)
        assert _sq(k[1], k2[1]) < 0.25 * _sq(k[1], mx.zeros_like(k[1]))


@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float32])
def test_exact_tokens_keep_their_dtype(dtype):
    caches = prefilled(100, dtype=dtype)
    kt.save(tmp("dtype.kvtc"), caches, basis=basis(), ratio=4, window=WINDOW)
    back = kt.load(tmp("dtype.kvtc"), basis=basis())
    for (k, v), (k2, v2) in zip(_kv(caches), _kv(back)):
        assert k2.dtype == v2.dtype == dtype
        assert bool(mx.array_equal(k[:, :, -WINDOW:], k2[:, :, -WINDOW:]))
        assert bool(mx.array_equal(v[:, :, :SINKS], v2[:, :, :SINKS]))


def test_loaded_caches_continue_decoding():
    m, caches = model(), prefilled(200)
    kt.save(tmp("cont.kvtc"), caches, basis=basis(), ratio=3, metadata={"note": "x"})
    back, meta = kt.load(tmp("cont.kvtc"), basis=basis(), model=m, return_metadata=True)
    assert meta == {"note": "x"}
    nxt = prompt(4, seed=9)
    ref = m(nxt, cache=caches)[0].astype(mx.float32)
    got = m(nxt, cache=back)[0].astype(mx.float32)
    assert [c.offset for c in back] == [204, 204]
    lp = ref - mx.logsumexp(ref, axis=-1, keepdims=True)
    lq = got - mx.logsumexp(got, axis=-1, keepdims=True)
    kl = float(mx.mean(mx.sum(mx.exp(lp) * (lp - lq), axis=-1)))
    assert kl < 0.05, kl


def test_velox_caches_come_back_as_the_same_method():
    m = model()
    caches = make_cache(m, "uniform:bits=8,group=32,window=8", storage_dtype=mx.float16)
    with routed(m):
        m(prompt(180), cache=caches)
    kt.save(tmp("velox.kvtc"), caches, basis=basis(), ratio=3)
    back = kt.load(tmp("velox.kvtc"), basis=basis(), model=m)
    no_model = kt.load(tmp("velox.kvtc"), basis=basis())
    for c, c2, c3 in zip(caches, back, no_model):
        assert type(c2) is type(c) is type(c3)
        assert c2.config() == c.config() and c2.offset == c.offset == 180
        assert c2.storage_dtype == mx.float16
    with routed(m):
        out = m(prompt(2, seed=3), cache=back)
    assert out.shape[1] == 2 and back[0].offset == 182


def test_sizes_account_for_every_byte():
    caches = prefilled(200)
    path = tmp("sizes.kvtc")
    s = kt.save(path, caches, basis=basis(), ratio=4, window=WINDOW)
    data = path.read_bytes()
    assert s.total == len(data) == s.header + s.exact + s.codes + s.scales
    h, dk = 2, 32
    assert s.exact == 2 * 2 * 1 * (SINKS + WINDOW) * h * dk * 2  # 2 layers, K and V, fp16
    assert s.fp16 == 2 * 200 * 2 * h * (dk + dk)
    save_cache(tmp("fp16.safetensors"), caches)
    fp16_arrays = sum(a.nbytes for k, v in _kv(caches) for a in (k, v))
    assert s.fp16 == fp16_arrays
    assert s.basis == basis().nbytes > 0
    info = kt.inspect(path)
    assert info["bytes"] == {
        "total": s.total,
        "exact": s.exact,
        "codes": s.codes,
        "scales": s.scales,
        "header": s.header,
        "basis": s.basis,
        "fp16": s.fp16,
    }
    assert info["x_fp16"] == pytest.approx(s.fp16 / s.total)
    assert info["x_fp16_with_basis"] == pytest.approx(s.fp16 / (s.total + s.basis))
    assert info["tokens"] == 200 and info["ratio"] == "4"
    # the bytes are encode()'s, and a safetensors reader opens them
    assert kt.encode(caches, basis=basis(), ratio=4, window=WINDOW) == data
    arrays = mx.load(str(path), format="safetensors")
    assert arrays["exact.0.key"].shape == (1, 2, SINKS + WINDOW, 32)


def test_the_basis_is_found_by_its_id(monkeypatch, tmp_path):
    caches = prefilled(120)
    data = kt.encode(caches, basis=basis_file(), ratio=4)
    monkeypatch.setenv("VELOX_ARTIFACTS", str(tmp_path))
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.chdir(tmp_path)
    with pytest.raises(kt.MissingBasisError, match="basis="):
        kt.decode(data)
    kt.save_basis(basis(), tmp_path / "kvtc.safetensors")
    back = kt.decode(data)
    assert bool(mx.array_equal(_kv(back)[0][0][:, :, :SINKS], _kv(caches)[0][0][:, :, :SINKS]))
    # the model's own basis is found by its fingerprint at save time
    assert kt.encode(caches, model=model(), ratio=4) == data


def _craft(data: bytes, header=None, arrays=None) -> bytes:
    """``data`` with its header or arrays edited and its checksum made right again."""
    a, meta = unpack(data)
    h = json.loads(meta["kvtc"])
    if header:
        header(h)
    if arrays:
        arrays(a)
    meta["kvtc"] = json.dumps(h)
    meta["sha256"] = digest(a, meta["kvtc"])
    return pack(a, meta)


def _set(key, value):
    return lambda h: h.__setitem__(key, value)


@pytest.mark.parametrize(
    "edit, match",
    [
        (dict(header=_set("tokens", 10)), "exceed tokens"),
        (dict(header=_set("batch", 0)), "batch must be an int >= 1"),
        (dict(header=_set("sinks", "4")), "sinks must be an int"),
        (dict(header=_set("ratio", "5")), "no plan for ratio 5"),
        (dict(header=_set("basis_id", "0" * 64)), "coded with basis"),
        (dict(header=_set("extra", 1)), "fields"),
        (dict(header=lambda h: h["layers"][0].__setitem__("kind", "pickle")), "unknown kind"),
        (dict(header=lambda h: h["layers"][1].__setitem__("dtype", "int8")), "dtype"),
        (dict(header=lambda h: h["layers"].pop()), "unexpected"),
        (dict(header=lambda h: h["plans"]["key"].append([1, "int8"])), "not the basis's"),
        (dict(header=lambda h: h["plans"]["key"].append([1, "int9"])), "dtype must be"),
        (dict(header=_set("user", {"a": 1})), "map str to str"),
        (dict(arrays=lambda a: a.pop("value.scales")), "missing"),
        (dict(arrays=lambda a: a.__setitem__("x", ("U8", np.zeros(1, np.uint8)))), "unexpected"),
        (
            dict(
                arrays=lambda a: a.__setitem__(
                    "exact.0.key", ("F32", a["exact.0.key"][1].astype(np.float32))
                )
            ),
            "not a float16",
        ),
        (
            dict(arrays=lambda a: a.__setitem__("key.codes", ("U8", a["key.codes"][1][:-9]))),
            "codes stream",
        ),
        (
            dict(arrays=lambda a: a.__setitem__("key.scales", ("U8", a["key.scales"][1] ^ 0x55))),
            "scales stream",
        ),
    ],
)
def test_crafted_files_are_refused(edit, match):
    data = kt.encode(prefilled(120), basis=basis(), ratio=4)
    kt.decode(_craft(data), basis=basis())  # the crafting itself keeps a file valid
    with pytest.raises(ValueError, match=match):
        kt.decode(_craft(data, **edit), basis=basis())


def test_corrupt_and_foreign_files_are_refused(tmp_path):
    caches = prefilled(120)
    data = kt.encode(caches, basis=basis(), ratio=4)
    cases = {
        "truncated.kvtc": (data[:-100], "truncated"),
        "short.kvtc": (data[:5], "too short"),
        "flipped.kvtc": (data[:-50] + bytes([data[-50] ^ 1]) + data[-49:], "checksum"),
        "header.kvtc": (b"\xff" * 8 + data[8:], "header of"),
        "json.kvtc": (data[:9] + b"#" + data[10:], "not JSON"),
    }
    for name, (blob, match) in cases.items():
        (tmp_path / name).write_bytes(blob)
        with pytest.raises(ValueError, match=match):
            kt.load(tmp_path / name, basis=basis())
    save_cache(tmp_path / "plain.safetensors", caches)
    with pytest.raises(ValueError, match="format 'velox-cache'"):
        kt.load(tmp_path / "plain.safetensors", basis=basis())
    with pytest.raises(ValueError, match="no such file"):
        kt.load(tmp_path / "missing.kvtc", basis=basis())
    with pytest.raises(ValueError, match="checksum"):
        kt.inspect(tmp_path / "flipped.kvtc")


def test_what_encode_refuses():
    b, caches = basis(), prefilled(60)
    with pytest.raises(ValueError, match="no plan for ratio 16"):
        kt.encode(caches, basis=b, ratio=16)
    with pytest.raises(ValueError, match="ratio must be > 1"):
        kt.encode(caches, basis=b, ratio=1)
    with pytest.raises(ValueError, match="sinks must be >= 0"):
        kt.encode(caches, basis=b, ratio=4, sinks=-1)
    with pytest.raises(TypeError, match="metadata"):
        kt.encode(caches, basis=b, ratio=4, metadata={"a": 1})
    with pytest.raises(ValueError, match="pass basis="):
        kt.encode(caches, ratio=4)
    with pytest.raises(TypeError, match="basis must be"):
        kt.encode(caches, basis=3, ratio=4)
    with pytest.raises(TypeError, match="basis must be"):
        kt.decode(kt.encode(caches, basis=b, ratio=4), basis=3)
    with pytest.raises(ValueError, match="finite"):
        kt.encode(caches, basis=b, ratio=float("nan"))
    with pytest.raises(ValueError, match="1 cached layers"):
        kt.encode(caches[:1], basis=b, ratio=4)
    bad = prefilled(60)
    k, v = bad[0].keys_and_values()
    bad[0].state = (k.at[0, 0, 30, 0].add(float("nan")), v, 60)
    with pytest.raises(ValueError, match="NaN or inf"):
        kt.encode(bad, basis=b, ratio=4)
    rot = [RotatingKVCache(max_size=64) for _ in range(2)]
    model()(prompt(40), cache=rot)
    with pytest.raises(ValueError, match="RotatingKVCache"):
        kt.encode(rot, basis=b, ratio=4)
    from velox_testing import conformance_model

    other = conformance_model(head_dim=64)
    with pytest.raises(ValueError, match="another model"):
        kt.encode(caches, basis=b, model=other, ratio=4)
    with pytest.raises(ValueError, match="another model"):
        kt.decode(kt.encode(caches, basis=b, ratio=4), basis=b, model=other)
    assert read_caches(caches)[1][0]["class"] == "KVCache"


def test_caches_that_evicted_tokens_are_refused():
    pytest.importorskip("velox_streamingllm")  # an evicting method (not in velox-core)
    evicting = make_cache(model(), "streamingllm:budget=32")
    with routed(model()):
        for i in range(0, 100, 10):  # chunks: the policy cuts between them
            model()(prompt(100)[:, i : i + 10], cache=evicting)
    assert evicting[0].size() < evicting[0].offset
    with pytest.raises(ValueError, match="no eviction"):
        kt.encode(evicting, basis=basis(), ratio=4)


def test_a_tampered_basis_is_refused(tmp_path):
    path = kt.save_basis(basis(), tmp_path / "b.safetensors")
    arrays = mx.load(str(path), format="safetensors")
    meta = json.loads(json.dumps(kt.load_basis(path).provenance()))
    assert meta["fingerprint"] == basis().fingerprint
    from velox_core.artifacts import read_metadata

    raw = read_metadata(path)
    arrays["key.mean"] = arrays["key.mean"] + 1.0
    mx.save_safetensors(str(tmp_path / "t.safetensors"), arrays, raw)
    with pytest.raises(ValueError, match="basis_id"):
        kt.load_basis(tmp_path / "t.safetensors")
