"""OSCAR: the conformance suite (fitted rotations, and the data-free Hadamard ablation), the
rotation's factors, the clip, the codes against a NumPy reference, bytes, artifacts."""

import math
from functools import partial

import mlx.core as mx
import numpy as np
import pytest
from _oscar_util import model_artifact, tmp

from velox_core import Uniform, VeloxCache, make, make_cache, routed
from velox_oscar import (
    CLIPS,
    METHOD,
    MissingArtifactError,
    OscarCache,
    OscarKeys,
    OscarValues,
    bit_reversal,
    br_permutation,
    clip_error,
    gram_by_head,
    hadamard_matrix,
    load_rotations,
    oscar_rotation,
    quantile_clip,
    save_rotations,
)
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


class TestOscar(CacheConformance):
    # per coded token and head, keys and values: 128 2-bit codes (32 B) and an fp16 scale and
    # minimum (4 B), against 256 B of fp16 each; 20 exact tokens and the fp16 rotations
    # (2 x 128 x 128 x 2 B = 64 KiB, 3% of fp16's 2 MiB at 2,048 tokens): 0.18 measured
    max_memory_ratio = 0.19
    # 2-bit codes move kv_data's peaked logits a lot (rotations fitted on a random model, not
    # on kv_data): measured 0.67 over 512 tokens (KIVI-2 0.67, TurboQuant-2 0.87 there)
    attention_error = 0.8
    bad_settings = (
        *named_refusals(
            bits=1,
            group=0,
            key_clip=[0.0, "0.9"],
            value_clip=1.5,
            rotation="random",
            artifact=3,
            layer=-1,
        ),
        ({"centre": 1}, "centre must be True or False"),
        ({"centre": "yes"}, "centre must be True or False"),
    )

    def make(self):
        return OscarCache(artifact=model_artifact(), layer=0, **SMALL)

    def make_precise(self):  # the model-level checks at 8 bits
        return OscarCache(bits=8, artifact=model_artifact(), **SMALL)


class TestOscar4Bits(CacheConformance):
    max_memory_ratio = 0.31  # 4-bit codes: 68 B a token and head against 256, 0.30 measured
    attention_error = 0.3  # the clip ratios fitted for 4 bits: measured 0.2

    def make(self):
        return OscarCache(bits=4, artifact=model_artifact(), layer=0, **SMALL)


class TestOscarCentred(CacheConformance):
    """Keys coded less their KV head's fitted mean (``centre=True``)."""

    # the codes and rotations as TestOscar's, and each side's (H, D) float32 mean: 0.18
    max_memory_ratio = 0.19
    attention_error = 0.8  # the conformance model's keys have a small mean: as TestOscar's

    def make(self):
        return OscarCache(artifact=model_artifact(), layer=0, centre=True, **SMALL)

    def make_precise(self):
        return OscarCache(bits=8, artifact=model_artifact(), centre=True, **SMALL)


class TestOscarChannelKeys(CacheConformance):
    """KIVI's per-channel keys beside OSCAR's rotated values (``keys="channel"``)."""

    # keys: 128 2-bit codes (32 B) and per 32-token group an fp16 scale and minimum per channel
    # (16 B a token); values as TestOscar's; one fp16 rotation (32 KiB); tokens wait in fp16
    # for a whole 32-token key group: 0.195 measured
    max_memory_ratio = 0.2
    attention_error = 0.8  # KIVI-2's keys on kv_data, OSCAR's values: measured 0.55
    bad_settings = (
        ({"keys": "token"}, "keys must be one of"),
        ({"keys": "channel", "key_group": 0}, "key_group"),
        ({"key_group": 32}, 'key_group applies to keys="channel" only'),
        ({"keys": "channel", "key_clip": 0.9}, "key_clip applies to OSCAR's rotated"),
        ({"keys": "channel", "centre": True}, "centre applies to OSCAR's rotated"),
    )

    def make(self):
        return OscarCache(artifact=model_artifact(), layer=0, keys="channel", key_group=32, **SMALL)

    def make_precise(self):
        return OscarCache(bits=8, artifact=model_artifact(), keys="channel", key_group=32, **SMALL)


class TestHadamardAblation(CacheConformance):
    """The data-free ablation: the Sylvester Hadamard basis and given clips, no artifact."""

    spec = "oscar:rotation=hadamard,key_clip=0.96,value_clip=0.92,window=16,sinks=4"
    precise_spec = "oscar:bits=8,rotation=hadamard,key_clip=1,value_clip=1,window=16,sinks=4"
    max_memory_ratio = 0.16  # no rotation state: the codes and the 20 exact tokens
    attention_error = 0.8  # measured 0.74


# -- the rotation's factors -------------------------------------------------------------------
def test_bit_reversal_and_the_eigenvalue_keyed_permutation():
    assert bit_reversal(8).tolist() == [0, 4, 2, 6, 1, 5, 3, 7]
    assert bit_reversal(1).tolist() == [0]
    lam = np.array([0.5, 4.0, 1.0, 3.0, 0.1, 2.0, 0.2, 0.3])  # ranks by size: 1,3,5,2,0,7,6,4
    perm = br_permutation(lam)
    order = np.argsort(-lam)
    for i in range(8):  # output channel br(i) takes the column of the i-th largest eigenvalue
        assert perm[bit_reversal(8)[i]] == order[i]
    with pytest.raises(ValueError, match="power-of-two"):
        bit_reversal(12)
    # consecutive ranks land in different 32-channel groups of a 128-dim head
    lam = np.linspace(1, 2, 128)
    slot = np.argsort(br_permutation(lam))  # the output channel of each column
    top = np.argsort(-lam)[:4]
    assert len({int(slot[c]) // 32 for c in top}) == 4


def test_oscar_rotation_is_u_h_p_and_orthogonal():
    rng = np.random.default_rng(0)
    a = rng.normal(size=(64, 64)) * np.exp(rng.normal(size=64))
    cov = a @ a.T
    r, lam = oscar_rotation(cov)
    assert np.allclose(r @ r.T, np.eye(64), atol=1e-12)
    h = hadamard_matrix(64)
    assert np.allclose(h @ h, np.eye(64), atol=1e-12) and np.allclose(h, h.T)
    # undo the permutation and the Hadamard: the columns are the covariance's eigenvectors
    u = r[:, np.argsort(br_permutation(lam))] @ h
    assert np.allclose(cov @ u, u * lam[None, :], atol=1e-8 * lam.max())
    assert np.all(np.diff(lam) >= 0)  # eigh's ascending order, kept in the artifact


def test_quantile_clip_thresholds_each_row_at_its_order_statistic():
    rng = np.random.default_rng(1)
    x = rng.standard_t(3, size=(5, 7, 128)).astype(np.float32)
    for ratio in (0.96, 0.92, 0.5):
        got = np.array(quantile_clip(mx.array(x), ratio))
        tau = np.sort(np.abs(x), axis=-1)[..., int(ratio * 128)][..., None]
        assert np.array_equal(got, np.clip(x, -tau, tau))
        assert (np.abs(x) > tau).sum(-1).max() <= 128 - int(ratio * 128) - 1
    assert np.array_equal(np.array(quantile_clip(mx.array(x), 1.0)), x)  # 1 clips nothing


def test_gram_by_head_groups_the_query_heads_of_each_kv_head():
    q = mx.random.normal((2, 6, 5, 16), key=mx.random.key(0))  # 6 query heads, 2 KV heads
    got = np.array(gram_by_head(q, 2))
    x = np.array(q)
    for h in range(2):
        rows = x[:, 3 * h : 3 * h + 3].reshape(-1, 16)
        assert np.allclose(got[h], rows.T @ rows, rtol=1e-4, atol=1e-4)


# -- the codes --------------------------------------------------------------------------------
def _numpy_codes(x: np.ndarray, r: np.ndarray, ratio: float, group: int) -> np.ndarray:
    """The paper's pipeline in NumPy: rotate, clip at the row's order statistic, asymmetric
    2-bit min-max per group (fp16 scale and minimum), decode, rotate back."""
    y = x @ r
    tau = np.sort(np.abs(y), axis=-1)[..., int(ratio * y.shape[-1])][..., None]
    y = np.clip(y, -tau, tau)
    g = y.reshape(*y.shape[:-1], -1, group)
    lo, hi = g.min(-1, keepdims=True), g.max(-1, keepdims=True)
    scale = np.maximum((hi - lo) / 3, 1e-8).astype(np.float16).astype(np.float32)
    lo = lo.astype(np.float16).astype(np.float32)
    q = np.clip(np.round((g - lo) / scale), 0, 3)
    return (q * scale + lo).reshape(y.shape) @ r.T


@pytest.mark.parametrize("group", [None, 32])
def test_codes_match_the_numpy_reference(group):
    k, _ = kv_data(t=64, dtype=mx.float32)
    c = OscarKeys(group=group, artifact=model_artifact(), layer=1)
    c.check(128, mx.float32)
    r = np.array(c.state()["rotation"], dtype=np.float32)
    want = _numpy_codes(np.array(k), r, c.ratio, group or 128)
    got = np.array(c.decode(c.encode(k)))
    assert np.abs(got - want).max() < 1e-3 * np.abs(want).max()
    assert c.ratio == load_rotations(model_artifact()).clip(1, "key", 2)
    # the codes are Uniform's, read by mx.quantized_matmul with the rotated query
    p = c.encode(k)
    q = mx.random.normal((1, 2, 3, 128), key=mx.random.key(1))
    assert rel_error(c.scores(q, p), q @ mx.swapaxes(c.decode(p), -1, -2)) < 1e-4
    w = mx.softmax(mx.random.normal((1, 2, 3, 64), key=mx.random.key(2)), axis=-1)
    assert rel_error(c.mix(w, p), w @ c.decode(p)) < 1e-4


def test_given_clips_override_the_fitted_ones_and_change_the_codes():
    k, _ = kv_data(t=64, dtype=mx.float32)
    fitted = OscarKeys(artifact=model_artifact(), layer=0)
    given = OscarKeys(clip=1.0, artifact=model_artifact(), layer=0)
    for c in (fitted, given):
        c.check(128, mx.float32)
    assert given.ratio == 1.0 and "clip" not in given.state() and "clip" in fitted.state()
    assert fitted.ratio < 1.0  # the fit clips on this model (0.9 measured)
    a, b = (np.array(c.decode(c.encode(k))) for c in (fitted, given))
    assert not np.allclose(a, b)


def test_bytes_are_the_codes_the_scales_and_the_rotations():
    k, v = kv_data(t=1024)
    for group, per_group in ((None, 128), (32, 32)):
        c = OscarCache(artifact=model_artifact(), layer=0, window=0, sinks=0, flush=64, group=group)
        feed(c, k, v, 256)
        mx.eval(c.state)
        coded = sum(s.tokens for s in coded_segments(c))
        exact = 1024 - coded
        state = 2 * (128 * 128 * 2 + 4 + 4)  # per side: fp16 rotation, clip ratio, head dim
        per_token = 2 * 2 * (128 * 2 // 8 + (128 // per_group) * 4)  # K and V, 2 heads
        assert c.logical_nbytes == coded * per_token + exact * 2 * 2 * 128 * 2 + state
        # 2 bits + 32 bits of metadata per group per element, besides the exact tokens
        assert per_token / (2 * 2 * 128) * 8 == 2 + 32 / per_group


def test_attention_reads_the_codes_in_the_rotated_basis(monkeypatch):
    """A decode step rotates the query once and the mix back once: no stored token is decoded
    into the model's basis (decode is never called)."""
    c = OscarCache(artifact=model_artifact(), layer=0, **SMALL)
    assert_attends_without_decoding(c, monkeypatch)
    # a prefill chunk attends in the rotated basis too (decode_rotated_as, never decode)
    out = c.attend(mx.random.normal((1, 4, 40, 128)).astype(mx.float16), scale=0.09, mask=None)
    assert out.shape == (1, 4, 40, 128)


def test_on_the_cpu_the_kernels_decline():
    seg = coded_segment(OscarCache(artifact=model_artifact(), layer=0, window=0, sinks=0))
    assert_cpu_declines(seg.key_codec, seg.keys, seg.value_codec, seg.values)


# -- artifacts and the model ------------------------------------------------------------------
def test_artifact_round_trip_holds_orthogonal_rotations():
    a = load_rotations(model_artifact())
    b = load_rotations(save_rotations(a, tmp("again.safetensors")))
    assert sorted(a.layers) == sorted(b.layers) == [0, 1]
    assert a.tables() == b.tables() and set(a.tables()) == {
        "clips",
        "hadamard_clips",
        "centred_clips",
        "hadamard_centred_clips",
    }
    assert a.fit_group == 0 and a.fingerprint == b.fingerprint
    for i, layer in a.layers.items():
        for side in ("key", "value"):
            r = layer[side]
            assert mx.array_equal(r, b.layers[i][side])
            r = r.astype(mx.float32)
            assert rel_error(r @ r.T, mx.eye(128)) < 2e-3  # float16 entries
            assert sorted(a.clips[i]) == list(range(2, 9))
            assert all(c in CLIPS for pair in a.clips[i].values() for c in pair)


def test_fitted_key_rotation_lowers_the_logit_error_of_the_clip_fit():
    """clip_error's key metric is the logit error under the query covariance: it is zero for
    keys the grid codes exactly, and at 2 bits OSCAR's fitted ratio is the grid's best."""
    a = load_rotations(model_artifact())
    k, _ = kv_data(t=256, dtype=mx.float32)
    from velox_core import Uniform
    from velox_oscar import Rotation

    rot = Rotation(a.rotation(0, "key").astype(mx.float16))
    metric = mx.broadcast_to(mx.eye(128)[None], (2, 128, 128))
    exact = rot.inverse(mx.zeros((2, 4, 128)) + 1.0)  # constant rows in the rotated basis
    assert clip_error(exact, rot, 1.0, Uniform(2, 128), metric) < 1e-4  # fp16 minimum only
    errs = [clip_error(k[0], rot, c, Uniform(2, 128), metric) for c in CLIPS]
    assert min(errs) < errs[0]  # clipping helps 2-bit codes of outlier-heavy keys


def test_missing_and_foreign_artifacts_are_refused(monkeypatch, tmp_path):
    fitted = OscarCache(artifact=model_artifact())
    assert_artifact_refusals(
        monkeypatch, tmp_path, MissingArtifactError, "oscar", fitted, OscarCache(), "rotations"
    )
    # the ablation with both clips given needs none
    caches = make_cache(conformance_model(), "oscar:rotation=hadamard,key_clip=0.9,value_clip=0.9")
    assert all(set(c.tiers[0].key_codec.state()) == {"dim"} for c in caches)
    assert_found_by_fingerprint(monkeypatch, tmp_path, "oscar", model_artifact())


def test_a_loaded_cache_needs_no_artifact(tmp_path):
    oscar = partial(OscarCache, **SMALL)
    loaded_without_artifact(conformance_model(), oscar, model_artifact(), tmp_path)


def test_head_dims_are_refused_by_name():
    model = conformance_model(80)
    with pytest.raises(ValueError, match=r"oscar: key head dim 80 is not a power of two"):
        OscarKeys(artifact=model_artifact(), layer=0).check(80, mx.float16)
    with pytest.raises(ValueError, match=r"oscar: value head dim 96 is not a power of two"):
        OscarCache().check_dims(128, 96)
    with pytest.raises(ValueError, match=r"oscar: group=48 must divide the key head dim 128"):
        make_cache(conformance_model(), OscarCache(artifact=model_artifact(), group=48))
    caches = make_cache(model, "oscar:rotation=hadamard,key_clip=0.9,value_clip=0.9,group=16")
    assert all(c.method == "oscar" for c in caches)


def test_split_refusal_follows_the_artifact():
    assert "fitted" in OscarCache.split_refusal(make("oscar").config(), True, False)
    free = make("oscar:rotation=hadamard,key_clip=0.9,value_clip=0.9").config()
    assert OscarCache.split_refusal(free, True, False) == ""
    assert "fitted" in OscarCache.split_refusal({**free, "value_clip": None}, False, True)


def test_recommended_settings_and_registry():
    assert METHOD.name == "oscar" and "2605.17757" in METHOD.paper
    c = make("oscar")
    assert (c.sinks, c.window) == (64, 256)  # the paper's BF16 sink and recent window
    kc, vc = c.tiers[0].key_codec, c.tiers[0].value_codec
    assert (kc.bits, vc.bits, kc.group, kc.clip, kc.rotation) == (2, 2, None, None, "oscar")
    c = make("oscar:key_bits=4,value_bits=2,key_clip=0.96,value_clip=0.92")
    kc, vc = c.tiers[0].key_codec, c.tiers[0].value_codec
    assert (kc.bits, vc.bits, kc.clip, vc.clip) == (4, 2, 0.96, 0.92)
    assert isinstance(c, VeloxCache) and math.isclose(vc.clip, 0.92)


def test_fit_command_show(capsys):
    from velox_oscar.__main__ import main

    out = shown_artifact(main, model_artifact(), capsys)
    assert '"fit_group": 0' in out and '"clips"' in out


# -- centred keys -----------------------------------------------------------------------------
def _offset_keys(t: int = 256, offset: float = 8.0):
    """kv_data's keys with a large common offset per KV head (what Gemma 3's global layers
    have), float32 ``(1, 2, t, 128)``, and its values."""
    k, v = kv_data(t=t, dtype=mx.float32)
    mu = offset * mx.random.normal((1, 2, 1, 128), key=mx.random.key(7))
    return k + mu, v


def _centred_codec(mean: mx.array, bits: int = 2, **kw) -> OscarKeys:
    """An OscarKeys on the test artifact's layer 0 whose key mean is ``mean`` (H, D)."""
    c = OscarKeys(bits, artifact=model_artifact(), layer=0, centre=True, **kw)
    c.check(128, mx.float32)
    c.set_state({**{n: a for n, a in c.state().items() if n != "dim"}, "mean": mean})
    c.check(128, mx.float32)
    return c


def test_centred_keys_leave_attention_unchanged_with_exact_codes():
    """At 8 bits the codes are near exact, and any key shift is exact for attention: with the
    fitted means, or means moved far off (2 per channel, keys of about 1), a model's logits
    after a prefill chunk and after a decode step over the codes stay those of an uncoded
    cache, the exact sinks and window beside the coded keys in one softmax (dropping
    ``q . mu`` from the scores, or ``mu R`` from a prefill's keys, gives 0.2-0.9)."""
    model = conformance_model()
    prompt = mx.random.randint(0, 512, (1, 300), key=mx.random.key(3))
    art = load_rotations(model_artifact())
    for i, layer in art.layers.items():
        far = 2.0 * mx.random.normal(layer["key_mean"].shape, key=mx.random.key(9 + i))
        layer["key_mean"] = layer["key_mean"] + far
    moved = str(save_rotations(art, tmp("moved-means.safetensors")))

    def logits(**settings):
        caches = make_cache(model, OscarCache(bits=8, sinks=4, **settings))
        with routed(model):
            model(prompt[:, :280], cache=caches)
            chunk = model(prompt[:, 280:], cache=caches)  # a prefill chunk over the codes
            step = model(mx.array([[7]]), cache=caches)  # a decode step
        return caches[0].tiers[0].key_codec, chunk, step

    _, *exact = logits(artifact=model_artifact(), window=1000)  # nothing coded
    for artifact, centre in ((model_artifact(), False), (model_artifact(), True), (moved, True)):
        kc, *got = logits(artifact=artifact, window=16, centre=centre)
        assert kc.centre is centre and ("mean" in kc.state()) is centre
        # 8-bit codes' own error: 0.011-0.020 measured, with or without centring
        assert all(rel_error(g, e) < 0.03 for g, e in zip(got, exact, strict=True))


def test_centring_is_exact_for_attention_and_takes_the_offset_off_the_codes():
    k, _ = _offset_keys()
    mean = mx.mean(k[0], axis=1)  # (H, D)
    plain = OscarKeys(artifact=model_artifact(), layer=0, clip=0.9)
    plain.check(128, mx.float32)
    centred = _centred_codec(mean, clip=0.9)
    q = mx.random.normal((1, 2, 3, 128), key=mx.random.key(1))
    errs = {}
    for name, c in (("plain", plain), ("centred", centred)):
        p = c.encode(k)
        kh = c.decode(p)
        # the codec answers for the keys themselves: scores read the codes and add q . mu
        assert rel_error(c.scores(q, p), q @ mx.swapaxes(kh, -1, -2)) < 1e-4
        rot = c.stored_rotation()
        # the float16 rotation is orthogonal to about 1e-3
        assert rel_error(c.decode_rotated_as(p, mx.float32), rot.forward(kh)) < 2e-3
        errs[name] = rel_error(kh, k)
    # a code per token spends its range on the offset; less it, the error is several times less
    assert errs["centred"] < errs["plain"] / 3


def test_centred_state_round_trip_and_refusals():
    k, _ = _offset_keys(t=64)
    mean = mx.mean(k[0], axis=1)
    c = _centred_codec(mean)
    st = c.state()
    assert set(st) == {"rotation", "clip", "mean", "dim"} and st["mean"].shape == (2, 128)
    d = OscarKeys(artifact=model_artifact(), layer=0, centre=True)
    d.set_state(st)  # what load_cache does: no artifact read
    assert mx.array_equal(d.decode(d.encode(k)), c.decode(c.encode(k))).item()
    with pytest.raises(ValueError, match=r"state must hold \['clip', 'dim', 'mean', 'rotation'\]"):
        d.set_state({n: a for n, a in st.items() if n != "mean"})
    with pytest.raises(ValueError, match=r"mean must be a finite \(H, D\) array"):
        d.set_state({**st, "mean": mx.full((2, 128), mx.nan)})
    with pytest.raises(ValueError, match=r"key mean is \(2, 64\), the cache holds 128-dim"):
        d.set_state({**st, "mean": mean[:, :64]})
    d.set_state({**st, "mean": mean[:1]})
    with pytest.raises(ValueError, match="fitted for 1 KV heads, the cache holds 2"):
        d.encode(k)
    with pytest.raises(ValueError, match="centre applies to keys only"):
        from velox_oscar import OscarValues

        OscarValues(centre=True)
    with pytest.raises(TypeError, match="centre must be True or False"):
        OscarKeys(centre="true")
    # the centred clips and the means are the artifact's; the value clips are the uncentred
    a = load_rotations(model_artifact())
    assert a.key_mean(0).shape == (2, 128)
    for b in range(2, 9):
        assert a.clip(0, "value", b, centred=True) == a.clip(0, "value", b)
    e = OscarKeys(artifact=model_artifact(), layer=1, centre=True)
    e.check(128, mx.float32)
    assert e.ratio == a.clip(1, "key", 2, centred=True)
    assert mx.array_equal(e.state()["mean"], a.key_mean(1)).item()


def test_a_loaded_centred_cache_needs_no_artifact(tmp_path):
    oscar = partial(OscarCache, centre=True, **SMALL)
    _, loaded = loaded_without_artifact(conformance_model(), oscar, model_artifact(), tmp_path)
    kc = loaded[0].tiers[0].key_codec
    assert kc.centre and kc.state()["mean"].shape == (2, 128)


def test_centred_keys_need_the_artifact_and_decline_the_kernels():
    free = "oscar:rotation=hadamard,key_clip=0.9,value_clip=0.9"
    assert OscarCache.split_refusal(make(free).config(), True, False) == ""
    assert "fitted" in OscarCache.split_refusal(make(free + ",centre=true").config(), True, False)
    assert make("oscar:centre=true").tiers[0].key_codec.centre
    from velox_oscar.kernels import kernel_keys

    k, _ = _offset_keys(t=64)
    plain = OscarKeys(artifact=model_artifact(), layer=0)
    plain.check(128, mx.float32)
    c = _centred_codec(mx.mean(k[0], axis=1))
    values = plain.quantizer.kernel_codes(plain.encode(k))  # per-token affine values
    assert kernel_keys(plain, plain.encode(k), (1, 2, 3, 128), values) is not None
    assert kernel_keys(c, c.encode(k), (1, 2, 3, 128), values) is None


# -- per-channel keys -------------------------------------------------------------------------
def _channel_codes(x: np.ndarray, group: int, bits: int = 2) -> np.ndarray:
    """KIVI's keys in NumPy: asymmetric min-max codes per channel over ``group`` tokens (fp16
    scale and minimum), decoded. Shapes: x ``(B, H, T, D)``, T a multiple of ``group``."""
    b, h, t, d = x.shape
    g = x.reshape(b, h, t // group, group, d)
    lo, hi = g.min(3, keepdims=True), g.max(3, keepdims=True)
    top = 2**bits - 1
    scale = np.maximum((hi - lo) / top, 1e-8).astype(np.float16).astype(np.float32)
    lo = lo.astype(np.float16).astype(np.float32)
    q = np.clip(np.round((g - lo) / scale), 0, top)
    return (q * scale + lo).reshape(x.shape)


def test_channel_keys_are_kivis_codes_beside_oscars_values():
    """``keys="channel"``: the keys are velox-core's per-channel ``Uniform`` codes (a NumPy
    reference of KIVI's), the values OSCAR's rotated ones; a decode step's attention over the
    codes matches softmax attention over the decoded keys and values, and within the code
    error attention over the exact ones."""
    k, v = kv_data(t=256, dtype=mx.float32)
    c = OscarCache(artifact=model_artifact(), layer=0, keys="channel", window=0, sinks=0)
    kc, vc = c.tiers[0].key_codec, c.tiers[0].value_codec
    assert isinstance(kc, Uniform) and (kc.axis, kc.group, kc.bits) == ("channel", 128, 2)
    assert isinstance(vc, OscarValues) and vc.rotation == "oscar"
    c.update_and_fetch(k, v)
    seg = next(s for s in c.segments() if s.key_codec is kc)
    assert seg.tokens == 256  # whole 128-token groups, nothing left exact
    got_k = np.array(kc.decode(seg.keys))
    want_k = _channel_codes(np.array(k), 128)
    assert np.abs(got_k - want_k).max() < 1e-3 * np.abs(want_k).max()
    ref_v = OscarValues(artifact=model_artifact(), layer=0)
    ref_v.check(128, mx.float32)
    assert np.allclose(np.array(vc.decode(seg.values)), np.array(ref_v.decode(ref_v.encode(v))))
    q = mx.random.normal((1, 4, 1, 128), key=mx.random.key(7))
    scale = 0.09

    def attention(keys, values):  # 4 query heads over 2 KV heads
        kk, vv = (mx.repeat(a, 2, axis=1) for a in (keys, values))
        w = mx.softmax(scale * q @ mx.swapaxes(kk, -1, -2), axis=-1)
        return w @ vv

    out = c.attend(q, scale=scale)
    decoded = attention(mx.array(got_k), vc.decode(seg.values))
    assert rel_error(out, decoded) < 1e-3
    exact = attention(k, v)
    err = rel_error(out, exact)
    # the 2-bit codes' error on kv_data's peaked logits (0.57 measured; the conformance bound)
    assert 1e-3 < err < TestOscarChannelKeys.attention_error, err


def test_channel_keys_bytes_and_what_they_read():
    """Per coded token and head: the 2-bit key codes and ``32 / key_group`` bits of key
    metadata an element; the value side as OSCAR's; only the value rotation is state. The data-
    free ablation (``rotation="hadamard"`` and a given value clip) needs no artifact."""
    k, v = kv_data(t=512)
    for key_group in (None, 64):
        c = OscarCache(
            artifact=model_artifact(),
            layer=0,
            window=0,
            sinks=0,
            keys="channel",
            key_group=key_group,
        )
        c.update_and_fetch(k, v)
        mx.eval(c.state)
        g = key_group or 128
        per_token = 2 * (128 * 2 // 8) * 2 + 2 * 128 * 4 // g + 2 * 4  # codes K+V, K/V scales
        state = 128 * 128 * 2 + 4 + 4  # the value rotation, clip ratio and head dim
        assert c.logical_nbytes == 512 * per_token + state
    free = make("oscar:keys=channel,rotation=hadamard,value_clip=0.9")
    assert not free.cfg.needs_artifact and free.tiers[0].key_codec.state() == {}
    assert OscarCache.split_refusal(free.config(), True, False) == ""
    assert "fitted" in OscarCache.split_refusal(make("oscar:keys=channel").config(), True, False)
    # the key head dim is free (groups run along tokens); the value head dim is OSCAR's
    OscarCache(keys="channel", rotation="hadamard", value_clip=0.9).check_dims(96, 128)
    with pytest.raises(ValueError, match=r"oscar: value head dim 96 is not a power of two"):
        OscarCache(keys="channel").check_dims(128, 96)


def test_a_loaded_channel_keys_cache_needs_no_artifact(tmp_path):
    oscar = partial(OscarCache, keys="channel", key_group=32, **SMALL)
    _, loaded = loaded_without_artifact(conformance_model(), oscar, model_artifact(), tmp_path)
    t = loaded[0].tiers[0]
    assert loaded[0].cfg.keys == "channel" and t.key_codec.axis == "channel"
    assert t.key_codec.group == 32 and "rotation" in t.value_codec.state()


def test_channel_keys_on_the_cpu_take_the_reference_path():
    c = OscarCache(artifact=model_artifact(), layer=0, window=0, sinks=0, keys="channel")
    seg = coded_segment(c)
    assert_cpu_declines(seg.key_codec, seg.keys, seg.value_codec, seg.values)
