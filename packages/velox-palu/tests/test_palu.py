"""Palu: the conformance suite, the derivation from the whitened SVD, ranks, artifacts."""

import math
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from _palu_util import BASE, kv_artifact, model_artifact, tmp

from velox_core import make, make_cache
from velox_palu import (
    METHOD,
    MissingArtifactError,
    PaluBases,
    PaluCache,
    PaluValues,
    allocate,
    bases_from_gram,
    load_bases,
    save_bases,
)
from velox_testing import (
    CacheConformance,
    assert_artifact_refusals,
    assert_found_by_fingerprint,
    coded_segments,
    conformance_model,
    feed,
    kv_data,
    rel_error,
)


class TestPalu(CacheConformance):
    # per token: 192-dim key and 256-dim value latents per group of 2 heads at 4 bits with
    # an fp16 scale and zero per head, an int32 position (0.24 of fp16), plus the bases
    # (fp16, 2 x 256 x 224 per side: 0.11 of fp16 at 2,048 tokens)
    max_memory_ratio = 0.4
    # kv_data keys at rank 192 of 256 and iid values (no low-rank structure to keep):
    # measured 0.45 (at full rank and 4 bits: 0.21)
    attention_error = 0.5

    bad_settings = (
        {"ratio": 0.0},
        {"ratio": 1.5},
        {"key_rank": 0},
        {"value_rank": -4},
        {"allocation": "greedy"},
        {"bits": 1},
        {"group": 16},  # without bits
        {"group": 0, "bits": 4},
        {"artifact": 3},
        {"layer": -1},
        {"budget": 64},
    )

    def make(self):
        return PaluCache(
            key_rank=192, value_rank=256, bits=4, artifact=kv_artifact(), layer=0, rope_base=BASE
        )

    def make_precise(self):  # fitted on the model; make_cache binds its RoPE
        return PaluCache(ratio=1.0, artifact=model_artifact())


# -- the derivation: whitened SVD of the projection == SVD of its outputs -----------------------
def _whitened_svd(w, x, rank):
    """Palu's construction (the authors' _per_head_whiten_decomposition_from_weight):
    S = chol(X^T X), W S = U Sigma V^T, L = U_r Sigma_r^1/2, R = Sigma_r^1/2 V_r^T S^-1."""
    s = np.linalg.cholesky(x.T @ x)
    u, sig, vt = np.linalg.svd(w @ s, full_matrices=False)
    half = np.diag(np.sqrt(sig[:rank]))
    return u[:, :rank] @ half, half @ vt[:rank] @ np.linalg.inv(s), sig[:rank]


@pytest.mark.parametrize("rank", [8, 40])
def test_whitened_svd_equals_projecting_outputs_on_their_right_singular_basis(rank):
    rng = np.random.default_rng(rank)
    n, gd, calib = 96, 64, 2000
    mix = rng.normal(size=(n, n)) * np.exp(rng.normal(0, 1, size=n))  # correlated inputs
    x = rng.normal(size=(calib, n)) @ mix
    w = rng.normal(size=(gd, n)) / np.sqrt(n)
    lf, rf, sig = _whitened_svd(w, x, rank)
    y = x @ w.T
    basis, sigma = (np.array(a, dtype=np.float64) for a in bases_from_gram((y.T @ y)[None], calib))
    u = basis[0, :, :rank]
    fresh = rng.normal(size=(50, n)) @ mix  # inputs the fit never saw
    palu = fresh @ (lf @ rf).T  # Palu's rebuilt outputs
    ours = (fresh @ w.T) @ u @ u.T  # the exact outputs projected on U_r
    assert np.allclose(palu, ours, atol=1e-6 * np.abs(palu).max()), np.abs(palu - ours).max()
    # the singular values agree (ours are per token), and Palu's latent x R^T is ours
    # up to the diagonal Sigma_r^1/2 it splits between its factors
    assert np.allclose(sigma[0, :rank] * np.sqrt(calib), sig, rtol=1e-6)
    latent_palu = fresh @ rf.T
    latent_ours = (fresh @ w.T) @ u / np.sqrt(sig)
    latent_ours *= np.sign(np.sum(latent_palu * latent_ours, axis=0))  # singular-vector signs
    assert np.allclose(latent_palu, latent_ours, atol=1e-6 * np.abs(latent_palu).max())
    # and the rank-r optimum: no other rank-r projection of these outputs does better
    err = np.linalg.norm(y - y @ u @ u.T)
    q, _ = np.linalg.qr(u + 0.01 * rng.normal(size=u.shape))
    assert err <= np.linalg.norm(y - y @ q @ q.T)


def test_value_codec_is_that_projection_and_mixes_from_the_latent():
    rng = np.random.default_rng(3)
    y = rng.normal(size=(1, 4, 300, 32)) * np.exp(rng.normal(0, 1, size=32))
    bias = rng.normal(size=(4, 32)).astype(np.float32)
    y = mx.array((y + bias[None, :, None]).astype(np.float32))
    from velox_palu import group_gram

    cent = y - mx.array(bias)[None, :, None]
    basis, sigma = bases_from_gram(np.array(group_gram(cent, 2)), 300)
    art = PaluBases(
        {(0, "key"): (basis, sigma), (0, "value"): (basis, sigma)},
        {(0, "value"): mx.array(bias)},
        2,
        {0: [32, 0]},
        {},
        fingerprint="synthetic",
    )
    path = save_bases(art, tmp("values.safetensors"))
    c = PaluValues(rank=24, artifact=path, layer=0)
    p = c.encode(y)
    assert p.data["latent"].shape == (1, 4, 300, 12)  # 24 dims per group of 2 heads, 12 each
    u = np.array(c.state()["basis"], dtype=np.float64)  # (G, gD, r)
    g = np.array(cent).reshape(1, 2, 2, 300, 32).transpose(0, 1, 3, 2, 4).reshape(1, 2, 300, 64)
    want = (g @ u @ np.swapaxes(u, -1, -2)).reshape(1, 2, 300, 2, 32).transpose(0, 1, 3, 2, 4)
    want = want.reshape(1, 4, 300, 32) + bias[None, :, None]
    assert rel_error(c.decode(p), mx.array(want.astype(np.float32))) < 2e-3  # fp16 latent
    w = mx.softmax(mx.random.normal((1, 4, 3, 300)), axis=-1)
    assert rel_error(c.mix(w, p), w @ c.decode(p)) < 1e-5


def test_scores_rebuild_keys_tile_by_tile(monkeypatch):
    import velox_palu.codec as codec

    c = PaluCache(key_rank=128, artifact=kv_artifact(), layer=0, rope_base=BASE)
    k, v = kv_data(t=300)
    c.update_and_fetch(k, v)
    kc = c.tiers[0].key_codec
    seg = next(s for s in c.segments() if s.key_codec is kc)
    q = mx.random.normal((1, 2, 3, 128))
    whole = kc.scores(q, seg.keys)
    monkeypatch.setattr(codec, "TILE", 64)
    tiled = kc.scores(q, seg.keys)
    assert tiled.shape == (1, 2, 3, 300) and rel_error(tiled, whole) < 1e-6
    ref = q @ mx.swapaxes(kc.decode(seg.keys), -1, -2)
    assert rel_error(tiled, ref) < 1e-6


def test_decoded_keys_are_mlx_rope_of_the_rebuilt_pre_rope_keys():
    c = PaluCache(key_rank=256, artifact=kv_artifact(), layer=0, rope_base=BASE).tiers[0].key_codec
    pre = mx.random.normal((1, 2, 20, 128))
    post = mx.fast.rope(pre, 128, traditional=False, base=BASE, scale=1.0, offset=5000)
    p = c.encode(post, mx.arange(5000, 5020))
    assert rel_error(c.rebuild(p, 2), pre) < 2e-3  # full rank: only the fp16 latent rounds
    assert rel_error(c.decode(p), post) < 2e-3


# -- ranks ---------------------------------------------------------------------------------------
def test_allocation_sums_exactly_and_follows_the_fisher_information():
    fisher = {
        (i, s): f
        for i, (fk, fv) in enumerate([(4, 1), (1, 1), (8, 0.5)])
        for s, f in (("key", fk), ("value", fv))
    }
    for ratio in (0.1, 0.3, 0.5, 0.77, 1.0):
        r = allocate(fisher, 256, ratio, 4)
        assert sum(r.values()) == 4 * round(ratio * 6 * 64)
        assert all(4 <= x <= 256 and x % 4 == 0 for x in r.values())
    r = allocate(fisher, 256, 0.3, 4)
    assert r[(2, "key")] >= r[(0, "key")] > r[(1, "key")] >= r[(2, "value")]
    uniform = allocate(dict.fromkeys(fisher, 1.0), 256, 0.5, 4)
    assert set(uniform.values()) == {128}
    with pytest.raises(ValueError, match="ratio"):
        allocate(fisher, 256, 0.0, 4)
    with pytest.raises(ValueError, match="divide"):
        allocate(fisher, 256, 0.5, 3)


def test_bytes_fall_with_the_rank():
    k, v = kv_data(t=1024)
    sizes = []
    for rank in (256, 192, 128, 64):
        c = PaluCache(
            key_rank=rank, value_rank=rank, artifact=kv_artifact(), layer=0, rope_base=BASE
        )
        feed(c, k, v, 256)
        mx.eval(c.state)
        coded = sum(s.tokens for s in coded_segments(c))
        state = sum(
            x.nbytes
            for t in c.tiers
            for x in (*t.key_codec.state().values(), *t.value_codec.state().values())
        )
        # per token: rank/2 fp16 latent dims per head for keys and values, an int32 position;
        # the state: fp16 bases (1, 256, rank) per side and the RoPE's frequencies
        assert coded == 1024
        assert c.logical_nbytes == 1024 * (2 * 2 * (rank // 2) * 2 + 4) + state
        assert state == 2 * 256 * rank * 2 + 64 * 4 + 2 * 4
        sizes.append(c.nbytes)
    assert sizes == sorted(sizes, reverse=True) and len(set(sizes)) == 4, sizes


def test_ratio_ranks_in_a_model_follow_the_artifact_fisher():
    model = conformance_model()
    caches = make_cache(model, PaluCache(ratio=0.5, artifact=model_artifact()))
    ks = [c.tiers[0].key_codec for c in caches]
    model(mx.array([[1, 2, 3]]), cache=caches)
    art = load_bases(model_artifact())
    want = allocate(
        {(i, s): art.fisher[i][j] for i in (0, 1) for j, s in enumerate(("key", "value"))},
        256,
        0.5,
        2,
    )
    got = {
        (i, s): getattr(c.tiers[0], f"{s}_codec").width
        for i, c in enumerate(caches)
        for s in ("key", "value")
    }
    assert got == want and sum(got.values()) == 512
    assert all(k.layer == i for i, k in enumerate(ks))


# -- artifacts -----------------------------------------------------------------------------------
def test_artifact_round_trip():
    a = load_bases(model_artifact())
    path = save_bases(a, tmp("again.safetensors"))
    b = load_bases(path)
    assert a.layers == b.layers == [0, 1] and a.fisher == b.fisher and a.layouts == b.layouts
    assert a.fingerprint == b.fingerprint and a.heads_per_group == b.heads_per_group == 2
    for key, (basis, sigma) in a.bases.items():
        assert mx.array_equal(basis, b.bases[key][0]) and mx.array_equal(sigma, b.bases[key][1])
        u = basis.astype(mx.float32)[0]
        assert rel_error(mx.swapaxes(u, 0, 1) @ u, mx.eye(256)) < 2e-3  # orthonormal


def test_foreign_missing_and_corrupt_artifacts_are_refused(monkeypatch, tmp_path):
    standalone = PaluCache(rope_base=BASE)  # no artifact named
    fitted = PaluCache(artifact=model_artifact())
    assert_artifact_refusals(
        monkeypatch, tmp_path, MissingArtifactError, "palu", fitted, standalone, "bases"
    )
    raw = Path(model_artifact()).read_bytes()
    bad = tmp_path / "cut.safetensors"
    bad.write_bytes(raw[:200])
    with pytest.raises(ValueError):
        load_bases(bad)
    bad.write_bytes(b"not a safetensors file at all")
    with pytest.raises(ValueError):
        make_cache(conformance_model(), PaluCache(artifact=bad))
    assert_found_by_fingerprint(monkeypatch, tmp_path, PaluCache(), model_artifact())


def test_artifact_must_fit_the_cache():
    k, v = kv_data(t=70, h=4)  # more than a flush: the cache codes them
    with pytest.raises(ValueError, match="KV heads"):
        PaluCache(key_rank=64, artifact=kv_artifact(), layer=0, rope_base=BASE).update_and_fetch(
            k, v
        )
    k, v = kv_data(t=70)
    for kw, msg in (
        ({"key_rank": 63}, "multiple of 2"),
        ({"key_rank": 512}, "at most"),
        ({"key_rank": 64, "bits": 4, "group": 48}, "multiple of 96"),
        ({"layer": 5}, "no layer 5"),
        ({"rope_base": BASE, "rope_traditional": True}, "layout"),
    ):
        c = PaluCache(**{"artifact": kv_artifact(), "layer": 0, "rope_base": BASE, **kw})
        with pytest.raises(ValueError, match=msg):
            c.update_and_fetch(k, v)


def test_no_retention_policy():
    from velox_core import RetentionPolicy, VeloxCache

    c = PaluCache(artifact=kv_artifact(), layer=0, rope_base=BASE)
    with pytest.raises(ValueError, match="across heads"):
        VeloxCache(
            policy=RetentionPolicy(budget=64),
            key_codec=c.tiers[0].key_codec,
            value_codec=c.tiers[0].value_codec,
        )


# -- settings and registry ----------------------------------------------------------------------
def test_recommended_settings_and_registry():
    assert METHOD.name == "palu" and "2407.21118" in METHOD.paper
    for s in METHOD.recommended:
        assert isinstance(make("palu", **s), PaluCache)
    c = make("palu:ratio=0.3,key_bits=3,value_bits=4,window=16")
    kc, vc = c.tiers[0].key_codec, c.tiers[0].value_codec
    assert (kc.ratio, kc.bits, vc.bits, c.window) == (0.3, 3, 4, 16)


def test_quantized_latents_in_a_model():
    from velox_core import routed

    model = conformance_model()
    prompt = mx.random.randint(0, 512, (1, 80), key=mx.random.key(7))
    ref = model(prompt)[:, -1]
    outs = {}
    for bits in (None, 8, 4):
        caches = make_cache(model, PaluCache(ratio=1.0, bits=bits, artifact=model_artifact()))
        with routed(model):
            outs[bits] = model(prompt, cache=caches)[:, -1]
    cos = {
        b: float((mx.sum(ref * o) / (mx.linalg.norm(ref) * mx.linalg.norm(o))).item())
        for b, o in outs.items()
    }
    assert cos[None] > 0.999 and cos[8] > 0.99 and cos[4] > 0.8 and math.isfinite(cos[4]), cos
