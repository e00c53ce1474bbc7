"""Fitting Q-Filters, what they predict, and the artifacts that carry them."""

import gzip
import json

import mlx.core as mx
import numpy as np
import pytest
from _qfilters_util import (
    REFERENCE,
    REFERENCE_ARTIFACT,
    conformance_filters,
    keys_and_queries,
    received_attention,
    spearman,
)

from velox_core import make_cache, routed
from velox_qfilters import (
    MissingFiltersError,
    QFiltersCache,
    fingerprint,
    fit_filters,
    load_filters,
    principal_filters,
    resolve_filters,
    save_filters,
)
from velox_qfilters.__main__ import main
from velox_testing import conformance_model, tiny_model, tiny_tokenizer


def _cos(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(a @ b / np.linalg.norm(a) / np.linalg.norm(b))


def _queries(direction, scale, s=2000, d=64, seed=0):
    noise = mx.random.normal((s, d), key=mx.random.key(seed))
    return noise + scale * direction


# -- the mathematics -------------------------------------------------------------------------
def test_filter_is_the_oriented_principal_direction():
    u = mx.random.normal((64,), key=mx.random.key(1))
    u = u / mx.linalg.norm(u)
    for sign in (1.0, -1.0):
        q = mx.stack([_queries(sign * u, 4.0, seed=i) for i in range(2)])  # (2, S, D)
        f = principal_filters(q, 1)[0]
        assert _cos(f, sign * u) > 0.99  # most queries project positively on the filter
    # ranking keys by <f, k> is ranking them by the mean logit E_q[<q, k>]
    keys = mx.random.normal((300, 64), key=mx.random.key(2)) * 2
    mean_logit = np.array(mx.mean(q @ keys.T, axis=(0, 1)))
    assert spearman(np.array(keys @ f), mean_logit) > 0.95


def test_orientation_follows_the_majority_of_queries():
    """The authors' rule: the sign under which most sampled queries project positively
    (here 60% at +1 and 40% at -5: the mean query projects negatively)."""
    d = 32
    u = mx.zeros((d,)).at[3].add(1.0)
    coef = mx.array([1.0] * 600 + [-5.0] * 400)[:, None]
    q = coef * u + 0.01 * mx.random.normal((1000, d), key=mx.random.key(3))
    f = principal_filters(q[None], 1)[0]
    assert float(f[3].item()) > 0.99
    assert float(mx.mean(q @ f).item()) < 0


def test_a_kv_head_averages_the_filters_of_its_query_heads():
    d = 64
    u = [mx.zeros((d,)).at[i].add(1.0) for i in (0, 1)]
    q = mx.stack([_queries(u[h // 2], 5.0, d=d, seed=h) for h in range(4)])  # heads 0,1 | 2,3
    f = principal_filters(q, 2)
    assert _cos(f[0], u[0]) > 0.99 and _cos(f[1], u[1]) > 0.99
    both = principal_filters(q, 1)[0]
    assert _cos(both, u[0] + u[1]) > 0.99
    with pytest.raises(ValueError):
        principal_filters(q, 3)
    with pytest.raises(ValueError):
        principal_filters(q[0], 1)


# -- what fitted filters predict ---------------------------------------------------------------
def _prediction(model, filters, ids, last=64):
    """Per (layer, KV head): Spearman of <f, k> with the attention keys receive from the last
    ``last`` queries, and the share of that attention held by the quarter of the keys with the
    largest and with the smallest <f, k>."""
    rows = []
    for i, (k, q) in enumerate(keys_and_queries(model, ids)):
        r = q.shape[0] // k.shape[0]
        for h in range(k.shape[0]):
            recv = received_attention(k[h], q[h * r : (h + 1) * r], last)
            score = np.array(k[h, : recv.size] @ filters.layer(i)[h])
            top, n = np.argsort(-score), recv.size // 4
            mass = recv.sum()
            rows.append(
                (i, spearman(score, recv), recv[top[:n]].sum() / mass, recv[top[-n:]].sum() / mass)
            )
    return rows


def test_fitted_filters_predict_attention_on_a_tiny_model():
    """A tiny llama whose queries lean on a direction (query biases, as in Qwen2): the fitted
    filters rank keys by the attention they receive, and flipping them ranks them backwards."""
    model = conformance_model(attention_bias=True)
    for i, layer in enumerate(model.model.layers):
        b = mx.random.normal(layer.self_attn.q_proj.bias.shape, key=mx.random.key(10 + i))
        layer.self_attn.q_proj.bias = b.astype(mx.float16)
    rng = np.random.default_rng(0)
    filters = fit_filters(model, rng.integers(0, 512, 1024), seq_len=512, samples=1024)
    rows = _prediction(model, filters, rng.integers(0, 512, 384))
    for _, rho, best, worst in rows:
        assert rho > 0.5 and best > 0.3 and worst < 0.2  # a quarter of the keys: chance 0.25


def test_reference_model_artifact_predicts_attention(monkeypatch):
    """The shipped artifact of the trained reference model, found by fingerprint, on held-out
    text (the filters were fitted on the training split)."""
    if not (REFERENCE.is_dir() and REFERENCE_ARTIFACT.is_file()):
        pytest.skip("the reference model and its artifact live in the velox repository")
    import mlx_lm

    model, tokenizer = mlx_lm.load(str(REFERENCE))
    monkeypatch.setenv("VELOX_ARTIFACTS", str(REFERENCE_ARTIFACT.parent))
    monkeypatch.setenv("HOME", "/nonexistent")
    assert resolve_filters(model) == REFERENCE_ARTIFACT
    filters = load_filters(REFERENCE_ARTIFACT)
    assert "train split" in filters.calibration["source"]
    with gzip.open(REFERENCE.parent / "data" / "heldout.jsonl.gz", "rt") as f:
        text = "".join(json.loads(line)["text"] for line, _ in zip(f, range(20)))
    ids = np.array(tokenizer.encode(text[:20000])[:1024])
    rows = _prediction(model, filters, ids, last=128)
    deep = [r for r in rows if r[0] > 0]  # the paper also finds the first layer an exception
    assert np.mean([r[1] for r in deep]) > 0.6
    assert all(best > 0.25 > worst for _, _, best, worst in deep)
    assert np.mean([r[2] for r in deep]) > 0.6 and np.mean([r[3] for r in deep]) < 0.1


# -- fitting inputs ----------------------------------------------------------------------------
def test_fit_from_text_or_ids_is_deterministic():
    model = tiny_model("llama")
    tok = tiny_tokenizer()
    text = "def add(a, b):\n    return a + b\n" * 40
    a = fit_filters(model, tok, text, samples=200, seq_len=128)
    ids = np.array([t for t in tok.encode(text)] + [tok.eos_token_id])
    b = fit_filters(model, ids, samples=200, seq_len=128)
    assert sorted(a.layers) == [0, 1] and a.layers[0].shape == (2, 64)
    assert a.calibration["tokens"] == b.calibration["tokens"] == len(ids)
    for i in a.layers:
        assert mx.array_equal(a.layers[i], b.layers[i])
    c = fit_filters(model, ids, samples=200, seq_len=128, seed=1)
    assert not mx.array_equal(a.layers[1], c.layers[1])  # another sample of queries
    for bad in ((tok, None), ("some text", None), (ids, "text"), ([], None), (tok, [1, 2])):
        with pytest.raises(TypeError):
            fit_filters(model, *bad)
    with pytest.raises(ValueError):
        fit_filters(model, ids, samples=0)


# -- artifacts, fingerprints, lookup -------------------------------------------------------------
def test_artifact_round_trip_and_bad_files(tmp_path):
    model = conformance_model()
    f = load_filters(conformance_filters())
    assert f.fingerprint == fingerprint(model) and f.model["head_dim"] == 128
    path = save_filters(f, tmp_path / "sub" / "x.safetensors")
    g = load_filters(path)
    assert (g.fingerprint, g.model, g.calibration) == (f.fingerprint, f.model, f.calibration)
    assert all(mx.array_equal(f.layers[i], g.layers[i]) for i in f.layers)
    with pytest.raises(ValueError, match="no layer 5"):
        g.layer(5)
    with pytest.raises(ValueError):
        save_filters(f, tmp_path / "x.npz")
    (tmp_path / "junk.safetensors").write_bytes(b"not a safetensors file")
    mx.save_safetensors(str(tmp_path / "other.safetensors"), {"a": mx.zeros(3)}, {"x": "y"})
    for name in ("junk", "other", "missing"):
        with pytest.raises(ValueError):
            load_filters(tmp_path / f"{name}.safetensors")


def test_fingerprint_identifies_the_weights():
    model = conformance_model()
    fp = fingerprint(model)
    assert fp == fingerprint(conformance_model())
    model.set_dtype(mx.float32)  # e.g. run in float32 on a CPU: the same checkpoint
    assert fingerprint(model) == fp
    layer = model.model.layers[1].mlp.up_proj
    layer.weight = layer.weight * 1.01  # a fine-tune of one matrix
    assert fingerprint(model) != fp
    assert fingerprint(tiny_model("llama", seed=1, head_dim=128, hidden_size=256)) != fp
    assert fingerprint(tiny_model("mistral", head_dim=128, hidden_size=256)) != fp


def test_explicit_filters_of_another_model_are_refused(tmp_path):
    other = tiny_model("llama", seed=1, head_dim=128, hidden_size=256)
    with pytest.raises(ValueError, match="fitted for another model"):
        make_cache(other, QFiltersCache(budget=64, window=8, filters=conformance_filters()))
    mx.save_safetensors(str(tmp_path / "w.safetensors"), {"a": mx.zeros(3)})
    with pytest.raises(ValueError, match="not a Q-Filters artifact"):
        resolve_filters(other, tmp_path / "w.safetensors")
    with pytest.raises(ValueError, match="no such file"):
        resolve_filters(other, tmp_path / "absent.safetensors")


def test_lookup_order(monkeypatch, tmp_path):
    model = conformance_model()
    f = load_filters(conformance_filters())
    home, d1, d2 = tmp_path / "home", tmp_path / "d1", tmp_path / "d2"
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.setenv("VELOX_ARTIFACTS", f"{d1}:{tmp_path / 'absent'}:{d2}")
    with pytest.raises(MissingFiltersError, match="python -m velox_qfilters fit --model PATH"):
        make_cache(model, QFiltersCache(budget=64, window=8))
    at_home = save_filters(f, home / ".cache" / "velox" / "m.safetensors")
    assert resolve_filters(model) == at_home
    in_d2 = save_filters(f, d2 / "m.safetensors")
    assert resolve_filters(model) == in_d2
    # a file of another model in the first directory is skipped; then a match there wins
    other = load_filters(conformance_filters())
    other.fingerprint = "0" * 32
    save_filters(other, d1 / "a.safetensors")
    (d1 / "b.safetensors").write_bytes(b"junk")
    assert resolve_filters(model) == in_d2
    in_d1 = save_filters(f, d1 / "c.safetensors")
    assert resolve_filters(model) == in_d1
    explicit = save_filters(f, tmp_path / "explicit.safetensors")
    assert resolve_filters(model, explicit) == explicit  # an explicit path wins
    monkeypatch.delenv("VELOX_ARTIFACTS")
    assert resolve_filters(model) == at_home
    caches = make_cache(model, QFiltersCache(budget=64, window=8))  # found by fingerprint
    prompt = mx.random.randint(0, 512, (1, 100), key=mx.random.key(0))
    with routed(model):
        model(prompt, cache=caches)
        model(prompt[:, :1], cache=caches)
    assert all(c.size() <= 65 for c in caches)


def test_cli_fit_and_show(tmp_path, monkeypatch, capsys):
    if not REFERENCE.is_dir():
        pytest.skip("the reference model lives in the velox repository")
    text = tmp_path / "calibration.txt"
    text.write_text("import os\n\ndef walk(path):\n    return list(os.walk(path))\n" * 60)
    out = tmp_path / "artifacts" / "ref.safetensors"
    args = ["fit", "--model", str(REFERENCE), "--text", str(text), "--out", str(out)]
    assert main([*args, "--tokens", "512", "--seq-len", "256", "--dtype", "float32"]) == 0
    import mlx_lm

    model, _ = mlx_lm.load(str(REFERENCE))
    monkeypatch.setenv("VELOX_ARTIFACTS", str(out.parent))
    assert resolve_filters(model) == out
    capsys.readouterr()
    assert main(["show", str(out)]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown["calibration"]["tokens"] == 512 and shown["layers"]["5"] == [2, 128]
    assert main(["show", str(text)]) == 2
