"""The spectral quantizer: the conformance suite, the fit's PCA, the codes against a NumPy
reference, attention from the codes, bytes, the rank, artifacts and refusals."""

from functools import partial

import mlx.core as mx
import numpy as np
import pytest
from _spectral_util import calibration, law_artifact, model_artifact, tmp

import velox_spectral.codec as spectral_codec
from velox_core import VeloxCache, make, make_cache
from velox_core.artifacts import prefilled
from velox_core.ops.lloyd_max import lloyd_max_gaussian
from velox_core.ops.rope import RopeSpec, find_rope, rope_spec, rotate
from velox_spectral import (
    DEFAULT_VARIANCE,
    METHOD,
    MissingArtifactError,
    SpectralCache,
    SpectralKeys,
    SpectralValues,
    fit_spectral,
    int8_columns,
    load_bases,
    pca,
    rank_for_variance,
    save_bases,
)
from velox_spectral.codec import code_words, packed_rank
from velox_spectral.fit import moved
from velox_testing import (
    CacheConformance,
    assert_artifact_refusals,
    assert_attends_without_decoding,
    assert_cpu_declines,
    assert_found_by_fingerprint,
    coded_segment,
    coded_segments,
    conformance_model,
    feed,
    kv_data,
    loaded_without_artifact,
    rel_error,
    shown_artifact,
)
from velox_testing.refusals import named_refusals

SMALL = {"window": 16, "sinks": 4}


class TestSpectral(CacheConformance):
    # the defaults (5-bit signal, 3-bit noise, the rank for 80% of the variance: 47 key and 96
    # value components of this artifact): codes and gains of the coded tokens (60 + 2 and 72 +
    # 2 B a token and head, against 256 B of fp16 each), the 20 exact ones and the int8 bases
    # (2 x 2 x 128 x 128 B = 64 KiB, 3% of fp16's 2 MiB at 2,048 tokens): 0.317 measured
    max_memory_ratio = 0.33
    # bases calibrated on kv_data's law (_spectral_util.law_artifact): 0.20 measured
    attention_error = 0.3
    bad_settings = (
        *named_refusals(signal_bits=[0, 9], noise_bits=-1, rank=[0, 2.5]),
        *named_refusals(variance=[0.0, 1.5, "0.9"], artifact=3, layer=-1),
        ({"signal_bits": 2, "noise_bits": 3}, "must not exceed signal_bits"),
        ({"rank": 8, "variance": 0.9}, "rank or variance"),
    )

    def make(self):
        return SpectralCache(artifact=law_artifact(), layer=0, **SMALL)

    def make_precise(self):  # the model-level checks at 8 bits
        return SpectralCache(signal_bits=8, noise_bits=8, artifact=law_artifact(), **SMALL)


class TestSpectralNoNoise(CacheConformance):
    """The noise components dropped: 4-bit codes of the leading 64 components only."""

    max_memory_ratio = 0.2  # 0.191 measured
    # kv_data's values are white noise: the 64 components dropped hold half their variance
    # (0.84 measured; the defaults' 0.20)
    attention_error = 0.9

    def make(self):
        return SpectralCache(noise_bits=0, rank=64, artifact=law_artifact(), layer=0, **SMALL)


# -- the fit ----------------------------------------------------------------------------------
def test_pca_is_the_covariance_eigendecomposition():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(2, 500, 16)) * np.exp(rng.normal(size=16)) + rng.normal(size=16)
    mean, lam, vec = pca(x.sum(1), np.swapaxes(x, -1, -2) @ x, 500)
    for h in range(2):
        cov = np.cov(x[h].T, bias=True)
        assert np.allclose(mean[h], x[h].mean(0))
        assert np.allclose(cov @ vec[h], vec[h] * lam[h], atol=1e-9 * lam[h, 0])
        assert np.allclose(vec[h].T @ vec[h], np.eye(16), atol=1e-12)
        assert np.all(np.diff(lam[h]) <= 0)  # descending
        big = np.argmax(np.abs(vec[h]), axis=0)  # each column's largest entry is positive
        assert np.all(vec[h][big, np.arange(16)] > 0)
    with pytest.raises(ValueError, match="at least 2 rows"):
        pca(x[:, :1].sum(1), np.zeros((2, 16, 16)), 1)


@pytest.mark.parametrize("positions", [0, 4096])
def test_fit_is_the_pca_of_the_cached_keys_and_values_past_skip(positions):
    """The artifact's mean and eigenvalues are those of every calibration token's key and
    value but the first ``skip`` of each sequence (gathered here by hand), the keys turned to
    positions drawn from ``[0, positions)`` (0: as the calibration made them)."""
    model, ids = conformance_model(), calibration()
    art = fit_spectral(model, ids, seq_len=512, positions=positions)
    assert art.calibration["skip"] == 4 and art.calibration["tokens"] == 1024
    assert art.calibration["positions"] == positions
    assert art.calibration["moved_layers"] == ([0, 1] if positions else [])
    rng = np.random.default_rng(0)
    rows: dict = {}
    for _, caches in prefilled(model, ids, 512, 512):
        for i, cache in caches:
            for side, x in zip(("key", "value"), cache.keys_and_values()):
                x = x[0, :, 4:].astype(mx.float32)
                if side == "key" and positions:
                    spec = rope_spec(find_rope(model, i))
                    x = moved(x, 4, spec, positions, rng)
                rows.setdefault((i, side), []).append(np.asarray(x, dtype=np.float64))
    for (i, side), parts in rows.items():
        x = np.concatenate(parts, axis=1)  # (H, 1016, D)
        got = art.side(i, side)
        assert np.allclose(np.asarray(got["mean"]), x.mean(1), atol=1e-4)
        for h in range(x.shape[0]):
            lam = np.linalg.eigvalsh(np.cov(x[h].T, bias=True))[::-1]
            assert np.allclose(np.asarray(got["eigenvalues"][h]), lam, rtol=1e-3, atol=1e-6)
    other = fit_spectral(model, ids, seq_len=512, skip=0, positions=positions)
    assert not np.allclose(
        np.asarray(other.side(0, "value")["mean"]), np.asarray(art.side(0, "value")["mean"])
    )
    with pytest.raises(ValueError, match="skip=512"):
        fit_spectral(model, ids, seq_len=512, skip=512)


def test_moved_keys_are_the_keys_at_the_drawn_positions():
    """A key made at position ``s`` and moved is the same pre-RoPE key turned to the drawn
    position ``p`` (RoPE composes), whatever the layout of its pairs."""
    for traditional in (False, True):
        spec = RopeSpec.from_base(10000.0, 64, traditional)
        base = mx.random.normal((2, 1, 64), key=mx.random.key(5))
        k0 = mx.broadcast_to(base, (2, 50, 64))  # one pre-RoPE key per head, 50 tokens
        made = rotate(k0[None], 7, spec)[0]  # at positions 7..56
        got = moved(made, 7, spec, 9000, np.random.default_rng(1))
        target = np.random.default_rng(1).integers(0, 9000, size=50)
        want = rotate(k0[None], mx.array(target), spec)[0]
        assert rel_error(got, want) < 1e-4
    assert int(target.max()) > 4500  # spread over the range, not the calibration's


@pytest.mark.parametrize(("sb", "nb", "rank"), [(4, 2, 128), (4, 4, None), (3, 1, 127)])
def test_a_rank_of_the_whole_head_codes_no_noise(sb, nb, rank):
    """Every component in the signal (given, or grown into by a variance rank at one width):
    no noise codes, and the codes still decode and attend."""
    k, _ = kv_data(t=32, dtype=mx.float32)
    c = SpectralKeys(sb, nb, rank=rank, artifact=model_artifact(), layer=0)
    c.check(128, mx.float32)
    p = c.encode(k)
    assert ("noise" in p.data) == (c.rank_in_use < 128)
    assert c.rank_in_use == (rank or 128)
    assert rel_error(c.decode(p), k) < 0.25  # 3 to 4 bits, bases of another law
    q = mx.random.normal((1, 2, 3, 128), key=mx.random.key(1))
    assert rel_error(c.scores(q, p), q @ mx.swapaxes(c.decode(p), -1, -2)) < 1e-5


def test_a_variance_rank_grows_into_the_word_padding():
    # 5/3 bits at 128 channels: rank 42 takes 7 + 9 words, 43 takes 7 + 8, 44 7 + 8
    assert [code_words(r, 128, 5, 3) for r in (42, 43, 44, 45)] == [16, 15, 15, 16]
    assert packed_rank(42, 128, 5, 3) == 44 and packed_rank(44, 128, 5, 3) == 44
    assert packed_rank(10, 128, 4, 4) == 128  # one width: the same words for every rank
    assert packed_rank(50, 128, 4, 0) == 56  # no noise: the signal's last word filled
    assert code_words(56, 128, 4, 0) == 7
    # a given rank is honoured as given
    c = SpectralKeys(5, 3, rank=42, artifact=model_artifact(), layer=0)
    c.check(128, mx.float16)
    assert c.rank_in_use == 42


def test_rank_for_variance_takes_the_largest_head():
    lam = np.array([[4.0, 3.0, 2.0, 1.0], [7.0, 1.0, 1.0, 1.0]])  # totals 10 and 10
    assert rank_for_variance(lam, 0.7) == 2  # head 0 needs 2 (0.7), head 1 needs 1
    assert rank_for_variance(lam, 0.8) == 3  # head 0 needs 3 (0.9), head 1 needs 2 (0.8)
    assert rank_for_variance(lam, 1.0) == 4
    assert rank_for_variance(lam[1:], 0.5) == 1


# -- the codes --------------------------------------------------------------------------------
def _numpy_codes(x, fit, r, sb, nb):
    """The pipeline in NumPy: project (the int8 basis's pseudo-inverse), scale by sigma,
    normalize by the RMS, nearest levels of the two Gaussian Lloyd-Max codebooks, the
    least-squares gain (fp16), decode through the basis."""
    basis = np.asarray(fit["basis"], dtype=np.float64) * np.asarray(fit["basis_scale"])[:, None]
    mean, sigma = (np.asarray(fit[n], dtype=np.float64) for n in ("mean", "sigma"))
    proj = np.linalg.pinv(basis)  # (H, k, D)
    z = np.einsum("htd,hkd->htk", x - mean[:, None], proj) / sigma[:, None]
    u = z / np.sqrt(np.mean(z * z, -1, keepdims=True))

    def nearest(u, bits):
        c = lloyd_max_gaussian(bits).centroids.astype(np.float64)
        return c[np.argmin(np.abs(u[..., None] - c), axis=-1)]

    c = nearest(u[..., :r], sb)
    if nb:
        c = np.concatenate([c, nearest(u[..., r:], nb)], axis=-1)
    s2 = sigma[:, None] ** 2
    g = np.sum(s2 * z * c, -1, keepdims=True) / np.sum(s2 * c * c, -1, keepdims=True)
    g = g.astype(np.float16).astype(np.float64)
    return np.einsum("htk,hdk->htd", g * sigma[:, None] * c, basis) + mean[:, None]


@pytest.mark.parametrize(
    ("cls", "sb", "nb", "rank"),
    [(SpectralKeys, 4, 2, 40), (SpectralValues, 3, 0, 70), (SpectralKeys, 5, 3, None)],
)
def test_codes_match_the_numpy_reference(cls, sb, nb, rank):
    k, v = kv_data(t=64, dtype=mx.float32)
    x = k if cls is SpectralKeys else v
    c = cls(sb, nb, rank=rank, artifact=model_artifact(), layer=1)
    c.check(128, mx.float32)
    r = c.rank_in_use
    lam = load_bases(model_artifact()).side(1, c.side)["eigenvalues"]
    assert r == (rank or packed_rank(rank_for_variance(lam, DEFAULT_VARIANCE), 128, sb, nb))
    want = _numpy_codes(np.asarray(x[0], dtype=np.float64), c.state(), r, sb, nb)
    got = np.asarray(c.decode(c.encode(x))[0])
    assert np.abs(got - want).max() < 1e-3 * np.abs(want).max()


@pytest.mark.parametrize("nb", [2, 0])
def test_scores_and_mix_read_the_codes_a_tile_at_a_time(monkeypatch, nb):
    monkeypatch.setattr(spectral_codec, "TILE", 48)  # 200 tokens: 5 tiles
    k, v = kv_data(t=200)
    for cls, x in ((SpectralKeys, k), (SpectralValues, v)):
        c = cls(3, nb, rank=50, artifact=model_artifact(), layer=0)
        c.check(128, mx.float16)
        p = c.encode(x)
        q = mx.random.normal((1, 2, 3, 128), key=mx.random.key(1))
        assert rel_error(c.scores(q, p), q @ mx.swapaxes(c.decode(p), -1, -2)) < 1e-5
        w = mx.softmax(mx.random.normal((1, 2, 3, 200), key=mx.random.key(2)), axis=-1) * 3
        assert rel_error(c.mix(w, p), w @ c.decode(p)) < 1e-5


def test_the_gain_is_the_least_squares_one():
    """Given the codes, the stored gain decodes closest: closer than the RMS normalization the
    codes were chosen with, and than the gain moved 2% either way."""
    k, _ = kv_data(t=128, dtype=mx.float32)
    c = SpectralKeys(2, 1, rank=32, artifact=model_artifact(), layer=0)
    c.check(128, mx.float32)
    packed = c.encode(k)
    gain = packed.data["gain"]

    def error(g):
        packed.data["gain"] = g
        return mx.sum((c.decode(packed) - k) ** 2, axis=-1)  # (1, H, T)

    best = error(gain)
    f = c.state()
    p = f["basis"].astype(mx.float32) * f["basis_scale"][:, None]
    z = ((k - f["mean"][None, :, None]) @ p) / f["sigma"][None, :, None]
    for other in (mx.sqrt(mx.mean(z * z, axis=-1)), gain * 1.02, gain * 0.98):
        assert mx.all(best <= error(other.astype(mx.float16)) * (1 + 1e-3)).item()
    assert mx.sum(best).item() < mx.sum(error(mx.sqrt(mx.mean(z * z, axis=-1)))).item()


def test_bytes_are_the_codes_the_gains_and_the_state():
    k, v = kv_data(t=1024)
    for nb, rank in ((2, 40), (0, 40), (3, 7)):
        c = SpectralCache(
            signal_bits=5,
            noise_bits=nb,
            rank=rank,
            artifact=model_artifact(),
            layer=0,
            window=0,
            sinks=0,
            flush=64,
        )
        feed(c, k, v, 256)
        mx.eval(c.state)
        coded = sum(s.tokens for s in coded_segments(c))
        exact = 1024 - coded
        words = -(-rank * 5 // 32) + (-(-(128 - rank) * nb // 32) if nb else 0)
        per_token = 2 * 2 * (4 * words + 2)  # K and V, 2 heads: packed words and the gain
        cols = 128 if nb else rank
        # per side: int8 basis, its float32 column scales, float32 mean and sigma, the rank
        state = 2 * (2 * 128 * cols + 2 * cols * 4 + 2 * 128 * 4 + 2 * cols * 4 + 4)
        assert c.logical_nbytes == coded * per_token + exact * 2 * 2 * 128 * 2 + state
    # 5-bit signal over 40 components and 2-bit noise over 88: 376 bits, 12 words
    assert -(-40 * 5 // 32) + -(-88 * 2 // 32) == 7 + 6


def test_attention_reads_the_codes(monkeypatch):
    """A decode step scores and mixes the codes: no stored token is decoded."""
    c = SpectralCache(artifact=model_artifact(), layer=0, **SMALL)
    assert_attends_without_decoding(c, monkeypatch)


def test_no_kernel_reads_these_codes():
    seg = coded_segment(SpectralCache(artifact=model_artifact(), layer=0, window=0, sinks=0))
    assert seg.key_codec.kernel_values(seg.values, 128) is None
    assert seg.value_codec.kernel_values(seg.values, 128) is None
    assert_cpu_declines(seg.key_codec, seg.keys, seg.value_codec, seg.values)


# -- the rank ---------------------------------------------------------------------------------
def test_the_rank_follows_variance_per_layer_and_side():
    art = load_bases(model_artifact())
    caches = make_cache(conformance_model(), SpectralCache(variance=0.6, artifact=model_artifact()))
    for i, cache in enumerate(caches):
        for codec in (cache.tiers[0].key_codec, cache.tiers[0].value_codec):
            lam = np.asarray(art.side(i, codec.side)["eigenvalues"])
            assert codec.rank_in_use == packed_rank(rank_for_variance(lam, 0.6), 128, 5, 3)
            assert codec.state()["basis"].shape == (2, 128, 128)
            assert codec.state()["basis"].dtype == mx.int8
    caches = make_cache(
        conformance_model(), SpectralCache(noise_bits=0, rank=20, artifact=model_artifact())
    )
    assert caches[1].tiers[0].value_codec.state()["basis"].shape == (2, 128, 20)
    with pytest.raises(ValueError, match="rank=200 exceeds the key head dim 128"):
        make_cache(conformance_model(), SpectralCache(rank=200, artifact=model_artifact()))


# -- artifacts and the model ------------------------------------------------------------------
def test_artifact_round_trip_holds_orthonormal_int8_bases():
    a = load_bases(model_artifact())
    b = load_bases(save_bases(a, tmp("again.safetensors")))
    assert sorted(a.layers) == sorted(b.layers) == [0, 1] and a.fingerprint == b.fingerprint
    for i in a.layers:
        for side in ("key", "value"):
            for name in ("basis", "basis_scale", "mean", "eigenvalues"):
                assert mx.array_equal(a.side(i, side)[name], b.side(i, side)[name])
            f = a.side(i, side)
            assert f["basis"].shape == (2, 128, 128) and f["basis"].dtype == mx.int8
            p = f["basis"].astype(mx.float32) * f["basis_scale"][:, None]
            eye = mx.broadcast_to(mx.eye(128), p.shape)
            assert rel_error(mx.swapaxes(p, -1, -2) @ p, eye) < 0.05  # int8 columns
    rng = np.random.default_rng(3)
    q, _ = np.linalg.qr(rng.normal(size=(2, 64, 64)))
    codes, scale = int8_columns(q)
    assert np.abs(codes * scale[:, None] - q).max() <= scale.max() / 2 + 1e-7
    assert np.all(np.abs(codes).max(axis=1) == 127)  # each column's largest entry: the scale
    bad = load_bases(model_artifact())
    bad.layers[0]["key"]["eigenvalues"] = bad.layers[0]["key"]["eigenvalues"][:, ::-1]
    with pytest.raises(ValueError, match="descending"):
        save_bases(bad, tmp("bad.safetensors"))
    bad = load_bases(model_artifact())
    bad.layers[1]["value"]["basis"] = bad.layers[1]["value"]["basis"].astype(mx.float16)
    with pytest.raises(ValueError, match="int8 codes"):
        save_bases(bad, tmp("bad.safetensors"))


def test_missing_and_foreign_artifacts_are_refused(monkeypatch, tmp_path):
    fitted = SpectralCache(artifact=model_artifact())
    assert_artifact_refusals(
        monkeypatch, tmp_path, MissingArtifactError, "spectral", fitted, SpectralCache(), "bases"
    )
    k, v = kv_data(t=100)
    c = SpectralCache(artifact=model_artifact(), layer=0, sinks=0)  # 2 heads fitted, 1 given
    with pytest.raises(ValueError, match="fitted for 2 KV heads, the cache holds 1"):
        c.update_and_fetch(k[:, :1], v[:, :1])
    with pytest.raises(ValueError, match="64-dim heads"):
        SpectralKeys(artifact=model_artifact(), layer=0).check(64, mx.float16)
    assert_found_by_fingerprint(monkeypatch, tmp_path, "spectral", model_artifact())


def test_a_loaded_cache_needs_no_artifact(tmp_path):
    spectral = partial(SpectralCache, variance=0.7, **SMALL)
    caches, loaded = loaded_without_artifact(
        conformance_model(), spectral, model_artifact(), tmp_path
    )
    assert loaded[0].tiers[0].key_codec.rank_in_use == caches[0].tiers[0].key_codec.rank_in_use


def test_a_state_that_does_not_fit_the_settings_is_refused():
    c = SpectralKeys(rank=30, artifact=model_artifact(), layer=0)
    c.check(128, mx.float16)
    state = c.state()
    with pytest.raises(ValueError, match="saved rank 30"):
        SpectralKeys(rank=31).set_state(state)
    with pytest.raises(ValueError, match="basis has 128 columns"):
        SpectralKeys(noise_bits=0, rank=30).set_state(state)
    with pytest.raises(ValueError, match="state must hold"):
        SpectralKeys(rank=30).set_state({"basis": state["basis"]})
    again = SpectralKeys(rank=30)
    again.set_state(state)
    k, _ = kv_data(t=16)
    assert mx.array_equal(again.decode(again.encode(k)), c.decode(c.encode(k)))


def test_recommended_settings_and_registry():
    assert METHOD.name == "spectral" and isinstance(make("spectral"), VeloxCache)
    c = make("spectral")
    kc = c.tiers[0].key_codec
    assert (kc.signal_bits, kc.noise_bits, kc.rank, kc.variance) == (5, 3, None, None)
    assert (c.sinks, c.window) == (16, 0)
    c = make("spectral:signal_bits=5,noise_bits=0,rank=48,window=32")
    vc = c.tiers[0].value_codec
    assert (vc.signal_bits, vc.noise_bits, vc.rank, c.window) == (5, 0, 48, 32)


def test_fit_command_show(capsys):
    from velox_spectral.__main__ import main

    out = shown_artifact(main, model_artifact(), capsys)
    assert '"ranks"' in out and '"skip": 4' in out
