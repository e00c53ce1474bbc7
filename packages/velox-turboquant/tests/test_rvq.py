"""TurboQuant RVQ (``key_variant="rvq"``): VeloxQuant-MLX's two-stage residual codes, stored as
one ``2b``-bit code of the summed-stage table and read like TurboQuant_mse's codes."""

from __future__ import annotations

import itertools
import math
import shutil

import mlx.core as mx
import numpy as np
import pytest

from velox_core import make
from velox_core.ops import unpack
from velox_testing import CacheConformance, assert_kernel_partial, kv_data
from velox_testing.emulate import emulated_or_skip
from velox_turboquant import TurboQuant, TurboQuantCache, TurboQuantConfig
from velox_turboquant.residual import (
    ResidualCodebook,
    lloyd_max_laplace,
    lloyd_max_sphere,
    residual_scale,
)

needs_gxx = pytest.mark.skipif(
    shutil.which("g++") is None, reason="g++ is not installed: the kernels cannot be emulated"
)


def _gaussian(n, d, seed=0):
    """``(1, 1, n, d)`` float32 vectors of i.i.d. N(0, 1) entries."""
    x = np.random.default_rng(seed).standard_normal((n, d)).astype(np.float32)
    return mx.array(x[None, None])


def _distortion(codec, x):
    """Mean of ``||x - x_hat||^2 / ||x||^2`` over the vectors of ``x``."""
    err = mx.sum((codec.decode(codec.encode(x)) - x) ** 2, -1) / mx.sum(x * x, -1)
    return float(mx.mean(err).item())


# -- the Laplacian codebook ---------------------------------------------------------------------
def _laplace_cell_mean(a: float, b: float, s: float) -> float:
    """``E[X | a < X < b]`` for the Laplacian of scale ``s`` and ``0 <= a < b <= inf`` (on the
    positive half it is an exponential law of mean ``s``, memoryless)."""
    if math.isinf(b):
        return a + s
    w = b - a
    return a + s - w * math.exp(-w / s) / (1 - math.exp(-w / s))


@pytest.mark.parametrize("bits", [1, 2, 3, 4])
def test_laplace_codebook_is_a_lloyd_max_fixed_point(bits):
    """Thresholds are the midpoints of the levels and each level is the Laplacian's mean over
    its cell (closed form, not the quadrature grid the codebook was fitted on)."""
    s = residual_scale(2, 128)
    cb = lloyd_max_laplace(bits, s)
    c, t = cb.centroids.astype(np.float64), cb.boundaries.astype(np.float64)
    assert len(c) == 2**bits and np.all(np.diff(c) > 0)
    np.testing.assert_allclose(c, -c[::-1], atol=1e-7 * s)
    np.testing.assert_allclose(t, (c[1:] + c[:-1]) / 2, rtol=1e-6)
    edges = [0.0, *t[t > 0].tolist(), math.inf]  # the positive cells (the law is symmetric)
    want = [_laplace_cell_mean(a, b, s) for a, b in itertools.pairwise(edges)]
    np.testing.assert_allclose(c[c > 0], want, rtol=2e-4)
    if bits == 1:
        assert abs(c[1] / s - 1) < 1e-4  # E|X| = s


def test_residual_scale_is_the_library_rule():
    d, b = 128, 2
    sigma_q = math.sqrt(1 / d) * (math.sqrt(3 * math.pi) / 2) * 4**-b
    assert residual_scale(b, d) == pytest.approx(sigma_q / math.sqrt(2), rel=1e-12)


def test_second_stage_scale_may_be_given():
    rc = ResidualCodebook(2, 128, scale=0.02)
    assert rc.scale == 0.02 and rc.second is lloyd_max_laplace(2, 0.02)
    assert ResidualCodebook(2, 128).scale == residual_scale(2, 128)


def test_codes_are_the_two_stage_pair_and_their_table_sums_the_stages():
    rc = ResidualCodebook(2, 128)
    y = _gaussian(1, 4096)[0, 0].reshape(32, 128) / math.sqrt(128)
    codes = rc.encode(y)
    i1, i2 = rc.stages(codes)
    assert mx.array_equal(i1, rc.first.encode(y)).item()
    assert mx.array_equal(i2, rc.second.encode(y - rc.first.decode(i1))).item()
    want = rc.first.decode(i1) + rc.second.decode(i2)
    assert mx.array_equal(rc.decode(codes), want).item()
    table = rc.centroids.reshape(4, 4)
    np.testing.assert_array_equal(table, rc.first.centroids[:, None] + rc.second.centroids[None])


# -- distortion: stage 1 + 2 against stage 1 alone and against a 2b-bit Lloyd-Max codebook ------
@pytest.mark.parametrize("stage_bits", [1, 2])
def test_second_stage_lowers_the_error_but_a_2b_bit_codebook_is_lower_still(stage_bits):
    """On Gaussian vectors at d = 128 (measured: 1 bit a stage 0.361 > 0.173 > 0.116; 2 bits
    0.116 > 0.047 > 0.0093 for mse at b, rvq at b + b, mse at 2b): RVQ's ``4^b`` levels are one
    ``2b``-bit scalar quantizer, which the ``2b``-bit Lloyd-Max codebook beats."""
    x = _gaussian(4096, 128)
    b = stage_bits
    one = _distortion(TurboQuant(b), x)
    rvq = _distortion(TurboQuant(2 * b, "rvq"), x)
    full = _distortion(TurboQuant(2 * b), x)
    assert one > rvq > full, (one, rvq, full)
    assert rvq < 0.6 * one  # the second stage removes a real share of the first's error
    assert abs(full / (128 * lloyd_max_sphere(2 * b, 128).mse) - 1) < 0.05


def test_first_stage_codes_are_turboquant_mse_codes():
    """The first stage is TurboQuant_mse at ``b`` bits: the same rotation, the same codes."""
    k, _ = kv_data(t=64)
    rvq, mse = TurboQuant(4, "rvq", seed=3), TurboQuant(2, "mse", seed=3)
    codes = unpack(rvq.encode(k).data["codes"], 4, 128)
    i1, _ = rvq.parts[0][1].codebook.stages(codes)
    assert mx.array_equal(i1, unpack(mse.encode(k).data["codes"], 2, 128)).item()


# -- storage ------------------------------------------------------------------------------------
@pytest.mark.parametrize("bits", [2, 4, 6, 8])
def test_bytes_per_token_are_those_of_a_2b_bit_code(bits):
    """``ceil(d * 2b / 32)`` words of codes and an fp16 norm, as mse at the same width; no
    reconstruction is kept."""
    k, _ = kv_data(t=64)
    rec = TurboQuant(bits, "rvq").encode(k)
    assert set(rec.data) == {"codes", "norm"} and rec.data["codes"].dtype == mx.uint32
    per_token = rec.nbytes / (1 * 2 * 64)
    assert per_token == 4 * math.ceil(128 * bits / 32) + 2
    assert rec.nbytes == TurboQuant(bits).encode(k).nbytes


def test_cache_holds_the_rvq_keys_at_their_width():
    k, v = kv_data(t=256)
    rvq = TurboQuantCache(bits=4, key_variant="rvq")
    mse = TurboQuantCache(bits=4)
    for c in (rvq, mse):
        c.update_and_fetch(k, v)
    kc = rvq.tiers[0].key_codec
    assert (kc.variant, kc.bits) == ("rvq", 4)
    # the same per-token bytes; the states differ by the codebook arrays only
    state = {n: a.nbytes for n, a in kc.state().items()}
    mse_state = {n: a.nbytes for n, a in mse.tiers[0].key_codec.state().items()}
    assert state == {"rot.signs": 512, "levels": 64}
    assert mse_state == {"rot.signs": 512, "levels": 64, "bounds": 60}
    assert rvq.nbytes == mse.nbytes - 60


# -- settings and state -------------------------------------------------------------------------
def test_spec_and_state_round_trip():
    c = make("turboquant:bits=2,key_variant=rvq,window=8")
    assert isinstance(c, TurboQuantCache) and c.cfg.key_variant == "rvq"
    assert c.tiers[0].value_codec.variant == "mse"
    k, v = kv_data(t=100)
    c.update_and_fetch(k, v)
    c2 = TurboQuantCache.from_state(c.state)
    assert c2.config() == c.config() and c2.tiers[0].key_codec.variant == "rvq"
    q = mx.random.normal((1, 4, 1, 128), key=mx.random.key(1)).astype(mx.float16)
    a, b = c.attend(q, scale=0.1), c2.attend(q, scale=0.1)
    assert np.abs(np.asarray((a - b).astype(mx.float32))).max() < 1e-3
    # an mse codec does not take an rvq codec's state, nor the other way round
    kc = c.tiers[0].key_codec
    with pytest.raises(ValueError, match="does not match"):
        TurboQuant(2, "mse").set_state(kc.state())
    mse = TurboQuant(2)
    mse.check(128, mx.float16)
    with pytest.raises(ValueError, match="does not match"):
        TurboQuant(2, "rvq").set_state(mse.state())


@pytest.mark.parametrize(
    ("settings", "match"),
    [
        ({"bits": 3, "key_variant": "rvq"}, "bits=3: the rvq variant"),
        ({"bits": 2.5, "key_variant": "rvq"}, "even integer"),
        ({"bits": 4, "key_bits": 5, "key_variant": "rvq"}, "key_bits=5"),
        ({"bits": 4, "key_variant": "rvq+prod"}, "key_variant"),
    ],
)
def test_bad_rvq_settings(settings, match):
    with pytest.raises(ValueError, match=match):
        TurboQuantConfig(**settings)


def test_bad_rvq_codec_and_codebook_arguments():
    for bits in (1, 3, 3.5):
        with pytest.raises(ValueError, match="rvq"):
            TurboQuant(bits, "rvq")
    with pytest.raises(ValueError, match="stage_bits"):
        ResidualCodebook(5, 128)
    with pytest.raises(ValueError, match="scale"):
        lloyd_max_laplace(2, 0.0)
    with pytest.raises(ValueError, match="scale"):
        ResidualCodebook(2, 128, scale=float("inf"))
    with pytest.raises(TypeError, match="scale"):
        ResidualCodebook(2, 128, scale="0.01")
    # rvq keys beside odd or fractional values are fine: only the keys are rvq
    assert TurboQuantConfig(bits=4, value_bits=3, key_variant="rvq").widths == (4, 3)


class TestTurboQuantRVQ(CacheConformance):
    spec = "turboquant:bits=4,key_variant=rvq"
    precise_spec = "turboquant:bits=8,key_variant=rvq"

    max_memory_ratio = 0.27  # 64 B of codes + an fp16 norm a vector, as 4-bit mse
    # measured 0.46 (peaked query) and 0.55 (test_trim's), against 0.32 and 0.22 for 4-bit
    # mse keys and 0.29 and 0.48 for 3-bit: 2 + 2 bits of rvq keys code like 3-bit ones
    attention_error = 0.65
    same_greedy_tokens = 32


# -- the kernel path ----------------------------------------------------------------------------
@pytest.fixture
def emulated_gpu(monkeypatch, tmp_path):
    return emulated_or_skip(monkeypatch, tmp_path)


@needs_gxx
@pytest.mark.parametrize(("bits", "values"), [(2, "mse"), (4, "mse"), (4, "rvq")])
def test_emulated_kernel_attention_matches_the_reference(emulated_gpu, bits, values):
    """rvq codes reach velox-core's codebook kernel as a ``bits``-bit table: the kernel path
    (decode attention and merge) equals the codec's reference scores/mix path."""
    k, v = kv_data(t=150 + bits)
    kc, vc = TurboQuant(bits, "rvq"), TurboQuant(bits, values, seed=1)
    emulated_gpu.calls.clear()
    kp = kc.encode(k)
    assert emulated_gpu.names == []  # rvq codes: two searches by MLX ops, no encode kernel
    vp = vc.encode(v)
    q = mx.random.normal((1, 2, 4, 128), key=mx.random.key(bits)) * 0.2
    assert_kernel_partial(emulated_gpu, q, kc, kp, vc, vp, 2e-5, "velox_decode_attention")
