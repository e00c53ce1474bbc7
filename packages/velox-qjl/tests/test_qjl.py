"""QJL: the conformance suite, and what is QJL's own (the estimator's mathematics, outliers,
the packed layout, the settings)."""

import math

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import QuantizedKVCache

from velox_core import Uniform, make
from velox_core.ops import jl_matrix, sign_sketch
from velox_qjl import METHOD, QJL, QJLCache
from velox_qjl.projection import sketch_inner
from velox_testing import (
    CacheConformance,
    assert_head_dim_refused,
    assert_tampered_state_refused,
    kv_data,
)

D = 128


class TestQJL(CacheConformance):
    """The paper's released setting: m = 2d, 8 outliers at 32 bits each, 2-bit values."""

    max_memory_ratio = 0.33  # measured 0.321 at 2,048 tokens, 128 of them fp16
    # 1-bit keys move the very peaked logits of kv_data a lot: measured 0.49 (attention test)
    # and 0.72 (trim test); mlx's own 4-bit codes give about 0.3 on the same data
    attention_error = 0.85
    same_greedy_tokens = 32

    bad_settings = (
        {"bits": 1},  # values need 2 bits at least
        {"value_bits": 1},
        {"key_bits": 2, "sketch": 256},
        {"sketch": 0},
        {"outliers": -1},
        {"outlier_bits": 0},
        {"orthogonal": 1},
    )

    def make(self):
        return QJLCache()

    def make_precise(self):
        return QJLCache(bits=8)


class TestQJLCoded(CacheConformance):
    """Every token coded (no fp16 window): m = 384, 8 outliers x 16 bits, 3-bit values."""

    max_memory_ratio = 0.30  # measured 0.289
    attention_error = 0.85  # measured 0.67 (attention test) and 0.50 (trim test)
    model_logit_cosine = 0.8  # measured 0.83 with m = 1024 (bits=8) and no fp16 window

    def make(self):
        return QJLCache(bits=3, outlier_bits=16, group=64, window=0)

    def make_precise(self):
        return QJLCache(bits=8, group=64, window=0)


# -- the estimator -------------------------------------------------------------------------------
def _estimates(q, k, seeds, **kw):
    """Scores of q against k from the codec, one row per seed. Shapes: (seeds, M, T)."""
    out = []
    for s in seeds:
        c = QJL(seed=s, **kw)
        c.check(k.shape[-1], k.dtype)
        out.append(np.array(c.scores(q, c.encode(k)))[0, 0])
    return np.stack(out)


def _pair():
    k, _ = kv_data(t=32, h=1, seed=3)
    k = k.astype(mx.float32)
    q = mx.random.normal((1, 1, 2, D), key=mx.random.key(4)) + k[:, :, :2] / 4
    return q, k, np.array(q @ mx.swapaxes(k, -1, -2))[0, 0]


@pytest.mark.parametrize(
    "kw",
    [
        {"sketch": 32, "outliers": 0, "orthogonal": False},
        {"sketch": 32, "outliers": 0, "orthogonal": True},
        {"sketch": 32, "outliers": 4, "outlier_bits": 4, "orthogonal": True},
    ],
)
def test_estimator_is_unbiased_over_seeds(kw):
    """Lemma 3.2: E_S[estimate] = <q, k> (for orthogonal rows with the exact constant too)."""
    q, k, true = _pair()
    est = _estimates(q, k, range(600), **kw)  # (600, 2, 32)
    z = (est.mean(0) - true) / (est.std(0) / math.sqrt(est.shape[0]))
    assert np.abs(z).max() < 4.5, np.abs(z).max()
    # the mean of z over correlated pairs stays near 0 as well (no systematic scale error)
    assert abs(np.median(z)) < 1.5


def test_variance_falls_as_one_over_m():
    """Lemma 3.5: Var = (pi/2 ||q||^2 ||k||^2 - <q,k>^2) / m for i.i.d. Gaussian rows."""
    q, k, true = _pair()
    qn = np.linalg.norm(np.array(q)[0, 0], axis=-1)[:, None]
    kn = np.linalg.norm(np.array(k)[0, 0], axis=-1)[None, :]
    theory = np.mean(math.pi / 2 * (qn * kn) ** 2 - true**2)
    mse = {}
    for m in (32, 128):
        est = _estimates(q, k, range(300), sketch=m, outliers=0, orthogonal=False)
        mse[m] = np.mean((est - true) ** 2)
        assert 0.85 < mse[m] * m / theory < 1.15, (m, mse[m] * m / theory)
    assert 3.4 < mse[32] / mse[128] < 4.7, mse[32] / mse[128]


def test_qjl_estimator_unbiased_and_variance_falls():
    rng = np.random.default_rng(0)
    q = mx.array(rng.standard_normal(64).astype(np.float32))
    k = mx.array(rng.standard_normal(64).astype(np.float32))
    true = float((q @ k).item())
    var = {}
    for m in (64, 256):
        ests = []
        for seed in range(300):
            s = jl_matrix(64, m, seed)
            bits = sign_sketch(k[None], s)
            ests.append(float(sketch_inner((q @ s.T)[None], bits, mx.linalg.norm(k)[None]).item()))
        ests = np.array(ests)
        assert abs(ests.mean() - true) < 4 * ests.std() / math.sqrt(len(ests))
        var[m] = ests.var()
    assert var[64] / var[256] == pytest.approx(4.0, rel=0.35)


def _score_mse(q, k, seeds, **kw):
    true = np.array(q @ mx.swapaxes(k, -1, -2))[0, 0]
    return np.mean((_estimates(q, k, seeds, **kw) - true) ** 2)


def _kv_queries():
    k, _ = kv_data(t=256, h=1, seed=1)
    k = k.astype(mx.float32)
    q = mx.random.normal((1, 1, 4, D), key=mx.random.key(7)) + k[:, :, -4:] / 4
    return q, k


def test_orthogonal_rows_lower_the_error():
    """Section 4.1: orthogonalizing the rows of S improves the estimator."""
    q, k = _kv_queries()
    iid = _score_mse(q, k, range(12), sketch=256, outliers=0, orthogonal=False)
    orth = _score_mse(q, k, range(12), sketch=256, outliers=0, orthogonal=True)
    assert orth < 0.8 * iid, (orth, iid)


def test_outlier_channels_lower_the_error_on_keys_with_outliers():
    """Section 4.1: sketching the outlier channels apart shrinks the norm that scales the
    error of the main sketch (Theorem 3.6), so at the same main sketch the error falls."""
    q, k = _kv_queries()
    plain = _score_mse(q, k, range(12), sketch=256, outliers=0)
    split = _score_mse(q, k, range(12), sketch=256, outliers=8, outlier_bits=16, group=32)
    assert split < 0.7 * plain, (split, plain)


def test_outlier_channels_are_each_blocks_largest():
    k, _ = kv_data(t=64, h=2)
    c = QJL(outliers=8, group=32)
    p = c.encode(k)
    got = np.array(c._indices(p))  # (1, 2, 2, 8)
    energy = (np.array(k.astype(mx.float32)) ** 2).reshape(1, 2, 2, 32, D).sum(axis=3)
    want = np.sort(np.argsort(-energy, axis=-1)[..., :8], axis=-1)
    assert np.array_equal(got, want)
    # the outlier sketch reconstructs those channels only, the inlier sketch the others
    mask = np.zeros((1, 2, 2, D), bool)
    np.put_along_axis(mask, want, True, axis=-1)
    mask = np.repeat(mask[:, :, :, None], 32, axis=3).reshape(1, 2, 64, D)
    no_in = np.array(c.decode(p.map(lambda n, a: a * 0 if n == "norm" else a)))
    no_out = np.array(c.decode(p.map(lambda n, a: a * 0 if n == "onorm" else a)))
    assert np.all(no_in[~mask] == 0) and np.all(no_in[mask] != 0)
    assert np.all(no_out[mask] == 0) and np.all(no_out[~mask] != 0)


def test_decode_is_an_unbiased_reconstruction_matching_the_scores():
    """E[k_hat] = k, and <q, k_hat> is exactly the compressed score."""
    q, k, _ = _pair()
    k = k[:, :, :4]
    recon = []
    for s in range(300):
        c = QJL(sketch=64, outliers=2, outlier_bits=16, group=4, seed=s)
        p = c.encode(k)
        k_hat = c.decode(p)
        if s < 3:
            direct = q @ mx.swapaxes(k_hat, -1, -2)
            assert np.allclose(np.array(c.scores(q, p)), np.array(direct), rtol=1e-4, atol=1e-2)
        recon.append(np.array(k_hat)[0, 0])
    r = np.stack(recon)
    z = (r.mean(0) - np.array(k)[0, 0]) / (r.std(0) / math.sqrt(len(r)))
    assert np.abs(z).max() < 5.0 and abs(np.mean(z)) < 0.2


# -- memory ---------------------------------------------------------------------------------------
def _layout_bytes(m, k, mo, vb, g, d=D):
    """Bytes per token and KV head from the packed layout (uint32 words, 16-bit norms/scales)."""
    words = lambda bits: 4 * -(-bits // 32)  # noqa: E731
    key = words(m) + 2
    if k:
        key += words(mo) + 2 + words(k * max(1, (d - 1).bit_length())) / g
    return key + words(d * vb) + 2 * 2 * (d // g)


@pytest.mark.parametrize(
    "kw, sizes",
    [
        ({"bits": 2, "outliers": 0, "group": 32}, (256, 0, 0, 2, 32)),
        ({"bits": 2, "group": 32}, (256, 8, 256, 2, 32)),
        (
            {"key_bits": 3, "value_bits": 4, "outliers": 4, "outlier_bits": 5, "group": 64},
            (384, 4, 20, 4, 64),
        ),
        ({"sketch": 200, "value_bits": 3, "outliers": 0, "group": 64}, (200, 0, 0, 3, 64)),
    ],
)
def test_bytes_per_token_match_the_packed_layout(kw, sizes):
    t, h = 512, 2
    k, v = kv_data(t=t, h=h)
    c = QJLCache(window=0, **kw)
    c.update_and_fetch(k, v)
    m, n_out, mo, vb, g = sizes
    proj = max(m, mo) * D * 2  # the float16 projection, resident state
    assert c.nbytes == t * h * _layout_bytes(m, n_out, mo, vb, g) + proj


def _fill(caches, prompt, steps, h):
    """A chunked prefill (512 tokens) then ``steps`` single-token decode steps, as velox bench."""
    k, v = kv_data(t=prompt + steps, h=h)
    for s in range(0, prompt, 512):
        for c in caches:
            c.update_and_fetch(k[:, :, s : s + 512], v[:, :, s : s + 512])
    for s in range(prompt, prompt + steps):
        for c in caches:
            c.update_and_fetch(k[:, :, s : s + 1], v[:, :, s : s + 1])
    mx.eval([c.state for c in caches])
    return [c.nbytes for c in caches]


@pytest.mark.parametrize("i, bits", [(1, 3), (2, 2)])
def test_recommended_settings_fit_the_bytes_of_mlx_quantized_cache(i, bits):
    """At 2,048 tokens x 8 KV heads (the projection amortized) each window-free recommended
    setting is no larger than mlx-lm's QuantizedKVCache(group 64) at the bits it stands for."""
    got, ref = _fill(
        [QJLCache(**METHOD.recommended[i]), QuantizedKVCache(group_size=64, bits=bits)], 2048, 0, 8
    )
    assert got <= ref, (got, ref)


@pytest.mark.parametrize("prompt, steps", [(4096, 0), (4096, 31), (8192, 0)])
def test_4bit_setting_fits_the_bytes_of_mlx_4bit_from_4k_tokens(prompt, steps):
    """The "4-bit" setting keeps a 384-token fp16 window, a fixed cost: at the reference
    model's 2 KV heads it is no larger than QuantizedKVCache(group 64, 4 bits) at 4,096 tokens
    (+ the 31 decode steps of velox bench's KL run) and at every length from about 4,600 on;
    between about 3,600 and 4,600 it depends on the window's block phase (docs/qjl.md)."""
    qjl = QJLCache(**METHOD.recommended[0])
    assert qjl.window == 384 and qjl.tiers[0].key_codec.sizes(D) == (320, 8, 64)
    got, ref = _fill([qjl, QuantizedKVCache(group_size=64, bits=4)], prompt, steps, 2)
    assert got <= ref, (got, ref)


def test_4bit_setting_is_larger_than_mlx_4bit_at_2k_tokens():
    """The window's fixed cost is not covered at 2,048 tokens x 2 KV heads (docs/qjl.md)."""
    qjl = QJLCache(**METHOD.recommended[0])
    got, ref = _fill([qjl, QuantizedKVCache(group_size=64, bits=4)], 2048, 0, 2)
    assert got > ref, (got, ref)


# -- settings --------------------------------------------------------------------------------------
def test_settings_map_to_the_codecs():
    c = QJLCache(bits=3, outlier_bits=16, group=64, window=0, seed=5)
    keys, values = c.tiers[0].key_codec, c.tiers[0].value_codec
    assert isinstance(keys, QJL) and keys.sizes(D) == (384, 8, 128) and keys.block == 64
    assert keys.seed == 5 and keys.orthogonal
    assert isinstance(values, Uniform) and values.axis == "token"
    assert (values.bits, values.group) == (3, 64) and c.window == 0
    split = QJLCache(key_bits=1, value_bits=4, outliers=0).tiers[0]
    assert split.key_codec.sizes(D) == (128, 0, 0) and split.key_codec.block == 1
    assert split.value_codec.bits == 4
    assert QJLCache(sketch=300, bits=2).tiers[0].key_codec.sizes(64) == (300, 4, 128)
    spec = make("qjl:bits=2,orthogonal=false,outliers=0")
    assert spec.tiers[0].key_codec.orthogonal is False


def test_head_dim_checks():
    k, v = kv_data(t=8, d=512)
    with pytest.raises(ValueError, match="outliers=0"):
        QJLCache(outliers=8).update_and_fetch(k, v)
    QJLCache(outliers=0, sketch=64, group=64).update_and_fetch(k, v)
    k, v = kv_data(t=8, d=16)
    with pytest.raises(ValueError, match="below the head dim"):
        QJLCache(outliers=16, group=16).update_and_fetch(k, v)


def test_saved_projection_must_match_the_seed():
    k, v = kv_data(t=64)
    c = QJLCache(window=0)
    c.update_and_fetch(k, v)
    assert_tampered_state_refused(c, "codec.tier0.k.proj", "projection")


def test_bits_one_with_value_bits_is_a_1bit_per_channel_sketch():
    c = QJLCache(bits=1, value_bits=2).tiers[0]
    assert c.key_codec.sizes(D)[0] == D and c.value_codec.bits == 2


@pytest.mark.parametrize("kw", [{}, {"outliers": 0}, {"group": 48}])
def test_long_inputs_encode_in_chunks_to_the_same_record(monkeypatch, kw):
    """Past ENCODE_ROWS (batch x head x token) rows the codec encodes whole blocks at a time
    (one call over 8 x 8 x 131,072 tokens failed on MLX's CUDA backend): the record is the
    one a single call gives, bit for bit."""
    import velox_qjl.codec as qc

    k, _ = kv_data(t=480, seed=3)
    codec = QJL(**kw)
    codec.check(D, k.dtype)
    whole = codec.encode(k)
    calls = []
    inner = QJL._encode
    monkeypatch.setattr(QJL, "_encode", lambda self, x: calls.append(x.shape[2]) or inner(self, x))
    monkeypatch.setattr(qc, "ENCODE_ROWS", 2 * 100)  # kv_data: 1 x 2 heads, so 100 tokens
    parts = codec.encode(k)
    step = 100 // codec.block * codec.block
    assert calls == [step] * (480 // step) + ([480 % step] if 480 % step else [])
    assert parts.tokens == whole.tokens and set(parts.data) == set(whole.data)
    for name in whole.data:
        assert mx.array_equal(parts.data[name], whole.data[name]).item(), name


def test_make_cache_refuses_a_head_dim_naming_qjl_and_its_parameter():
    assert_head_dim_refused("qjl", "group=32 must divide the value head dim 80", "qjl:group=16")
