"""XQuant: the conformance suite, the calibrated codes, and the layer pairs through make_cache."""

import math

import mlx.core as mx
import numpy as np
import pytest

from velox_core import load_cache, make, make_cache, routed, save_cache
from velox_core.ops import unpack
from velox_testing import (
    CacheConformance,
    assert_batch_generate_refused,
    assert_cpu_declines,
    assert_kernel_partial,
    assert_linked_copies,
    assert_rows_decode_alone,
    conformance_model,
    emulated_gpu_fixture,
    kv_data,
    needs_gxx,
    rel_error,
)
from velox_testing.kv import assert_scores_and_mix_decoded
from velox_xquant import XQuantCache, XQuantCodes, XQuantPair, default_eta
from velox_xquant import codec as xcodec


class TestXQuantAlone(CacheConformance):
    """A cache made alone has no pair: it codes its own keys and values (the single-cache
    checks). The model-level checks run through make_cache over the tiny 2-layer llama, whose
    layers 0 and 1 form a pair (share_from=0): layer 1 reads layer 0's codes. Its random
    weights give adjacent layers unrelated keys (no depth similarity for the pair to use), so
    make_precise (8 bits) keeps the pairs off (share_from=None) for the RoPE and offset checks."""

    spec = "xquant:bits=2"
    precise_spec = "xquant:bits=8,share_from=None"

    # 2 + 1 bits an entry (an fp16 scale and zero a group of 32), 128 to 191 fp16 tokens:
    # measured 0.238 of fp16 at 2,048 tokens (kivi:bits=2,group=32,window=128's bytes)
    max_memory_ratio = 0.25
    # measured 0.37; on the same data and query the same codes without the calibration (eta=0,
    # and kivi:bits=2,group=32,window=128) measure 0.48
    attention_error = 0.45

    bad_settings = (
        ({"eta": 0.5}, "eta must be below 0.5"),
        ({"eta": -0.1}, "eta must be >= 0"),
        ({"eta": "1/6"}, "eta must be a number"),
        ({"share": "kk"}, "share"),
        ({"share_from": -1}, "share_from must be >= 0"),
        ({"group": 0}, "group must be >= 1"),
        ({"bits": 0}, "bits must be >= 1"),
        ({"flush": 64}, "flush does not apply"),
    )

    def test_batch_generate_ragged(self):
        """mlx-lm batches separately made caches by merging each layer's caches alone, which
        cannot keep a pair's shared codes: a pair refuses it up front, naming what to do (a
        batch prefilled together works: test_a_batch_prefilled_together_equals_each_row_alone;
        without pairs the suite's check runs: TestXQuantUnpaired)."""
        model = conformance_model()
        caches = make_cache(model, self.make())
        assert caches[0].group is caches[1].group is not None
        with pytest.raises(ValueError, match="layer pair"):
            caches[1].merge([caches[1]])
        assert_batch_generate_refused(model, self.make, "share_from=None")


class TestXQuantUnpaired(CacheConformance):
    """One-bit keys and values, no pairs, a 32-token window and 4 sinks: the reference path's
    one-bit codes (no MLX layout) and mlx-lm's batching of separately made caches."""

    spec = "xquant:bits=1,share_from=None,window=32,sinks=4,group=64"
    precise_spec = "xquant:bits=8,share_from=None,window=32,sinks=4,group=64"

    # 1 + 0.5 bits an entry (groups of 64), 4 sinks and 32 to 95 fp16 tokens: measured 0.125
    max_memory_ratio = 0.13
    # one-bit codes move kv_data's peaked attention far (one query a check): measured 1.8,
    # 4.9 without the calibration (eta=0); uniform:bits=2 measures 2.03 on the same data
    attention_error = 2.0


# -- the calibrated codes --------------------------------------------------------------------------
def test_default_eta_is_the_middle_of_the_reference_grids():
    assert default_eta(1) == pytest.approx(1 / 6)
    assert default_eta(2) == 0.045
    assert default_eta(3) == default_eta(4) == default_eta(8) == 0.0
    c = XQuantCache(bits=1, value_bits=2)
    assert c.tiers[0].key_codec.eta == pytest.approx(1 / 6)
    assert c.tiers[0].value_codec.eta == 0.045
    assert XQuantCache(bits=2, eta=0.1).tiers[0].key_codec.eta == 0.1


@pytest.mark.parametrize("bits,axis", [(1, "token"), (2, "channel"), (3, "token")])
def test_calibration_moves_the_grid_inward_by_eta_of_the_range(bits, axis):
    """Codes of the min-max grid; stored ``z + eta s (2^B - 1)`` and ``(1 - 2 eta) s`` (numpy
    from the input's group ranges)."""
    x = mx.random.normal((1, 2, 64, 64), key=mx.random.key(bits)).astype(mx.float16)
    eta = 0.2
    plain = XQuantCodes(bits, 32, axis, eta=0.0).encode(x)
    cal = XQuantCodes(bits, 32, axis, eta=eta).encode(x)
    assert mx.array_equal(plain.data["codes"], cal.data["codes"]).item()
    s, z = (np.array(plain.data[n].astype(mx.float32)) for n in ("scale", "zero"))
    levels = (1 << bits) - 1
    np.testing.assert_allclose(
        np.array(cal.data["zero"].astype(mx.float32)), z + eta * s * levels, rtol=2e-3, atol=2e-3
    )
    np.testing.assert_allclose(
        np.array(cal.data["scale"].astype(mx.float32)), (1 - 2 * eta) * s, rtol=2e-3, atol=1e-4
    )
    # the min-max grid's ends are the group's min and max (to fp16 rounding)
    g = np.array(x.astype(mx.float32))
    if axis == "token":
        lo = g.reshape(1, 2, 64, 2, 32).min(-1)
    else:
        lo = g.reshape(1, 2, 2, 32, 64).min(3)
    np.testing.assert_allclose(z, lo, rtol=1e-3, atol=1e-3)


def test_one_bit_reconstruction_points_are_eta_inside_the_range():
    """At one bit a value is ``lo + eta (hi - lo)`` or ``hi - eta (hi - lo)`` (the paper's
    mapping ``f(e, eta)``), whichever half of the range it lies in."""
    x = mx.array(np.linspace(-1.0, 3.0, 32, dtype=np.float32).reshape(1, 1, 1, 32))
    codec = XQuantCodes(1, 32, "token", eta=1 / 6)
    got = np.array(codec.decode(codec.encode(x)))[0, 0, 0]
    xs = np.linspace(-1.0, 3.0, 32)
    want = np.where(xs <= 1.0, -1.0 + 4 / 6, 3.0 - 4 / 6)
    np.testing.assert_allclose(got, want, atol=2e-3)
    plain = XQuantCodes(1, 32, "token", eta=0.0)
    assert set(np.round(np.array(plain.decode(plain.encode(x))), 2).ravel()) == {-1.0, 3.0}


def test_calibration_lowers_the_one_and_two_bit_error_on_gaussian_groups():
    """Gaussian groups of 128 tokens: measured 1.88 -> 1.10 at one bit (eta 0 -> 1/6) and
    0.497 -> 0.460 at two bits (eta 0 -> 0.045)."""
    x = mx.random.normal((1, 4, 256, 128), key=mx.random.key(5))
    for bits, factor in ((1, 0.7), (2, 0.95)):
        err = {}
        for eta in (0.0, default_eta(bits)):
            c = XQuantCodes(bits, 128, "channel", eta=eta)
            err[eta] = rel_error(c.decode(c.encode(x)), x)
        assert err[default_eta(bits)] < factor * err[0.0], (bits, err)


@pytest.mark.parametrize(
    "bits,axis,group", [(1, "token", 128), (2, "channel", 64), (3, "token", 32)]
)
def test_scores_and_mix_read_the_codes_a_tile_at_a_time(bits, axis, group, monkeypatch):
    """The reference path (one-bit, three-bit or per-channel codes: no MLX layout) equals the
    decoded tokens, over several tiles and a partial last one."""
    monkeypatch.setattr(xcodec, "TILE", 128)
    k, _ = kv_data(t=448, d=128)
    c = XQuantCodes(bits, group, axis, eta=0.1)
    p = c.encode(k)
    assert len(p.tiles(xcodec.TILE)) == 4
    assert_scores_and_mix_decoded(c, p, c, p, seed=2, weights_seed=3)


# -- the layer pairs -------------------------------------------------------------------------------
def _model(layers=4):
    return conformance_model(num_hidden_layers=layers)


def _prefill(model, caches, t=300, seed=1):
    prompt = mx.random.randint(0, 512, (1, t), key=mx.random.key(seed))
    with routed(model):
        for s in range(0, t, 128):
            model(prompt[:, s : s + 128], cache=caches)
        model(mx.array([[3]]), cache=caches)
    return caches


def test_make_cache_pairs_each_odd_layer_from_share_from_with_the_one_below():
    caches = make_cache(_model(6), "xquant:bits=2,share_from=2")
    assert caches[0].group is caches[1].group is None
    assert isinstance(caches[2].group, XQuantPair) and caches[2].group is caches[3].group
    assert caches[4].group is caches[5].group is not caches[2].group
    assert [c.shared for c in caches] == ["", "", "kv", "kv", "kv", "kv"]
    keys = make_cache(_model(2), "xquant:bits=2,share=k")
    assert keys[0].shared == keys[1].shared == "k"
    assert make_cache(_model(2), "xquant:bits=2,share_from=None")[1].group is None
    assert make_cache(_model(3), "xquant")[2].group is None  # layer 2: the lower of no pair


def test_the_higher_layer_stores_no_codes_and_reads_the_lower_layers():
    """Layer 1 keeps its own calibrated scales and zeros of its own keys and values; its
    tokens are layer 0's codes times those (numpy), and only layer 0's bytes hold codes."""
    model = _model(2)
    caches = _prefill(model, make_cache(model, "xquant:bits=2,window=0"))
    low, up = caches
    for i in (0, 1):
        assert "codes" in low.group.codes[i].view().data
        assert set(up.stored.coded[0][i].view().data) == {"scale", "zero"}
        assert set(low.stored.coded[0][i].view().data) == {"scale", "zero"}
    seg = next(s for s in up.segments() if "codes" in s.keys.data)
    t, g = seg.keys.tokens, seg.key_codec.group
    q = np.array(unpack(low.group.codes[0].view().data["codes"], 2, 128)[:, :, :t])
    s = np.array(up.stored.coded[0][0].view().data["scale"].astype(mx.float32))
    z = np.array(up.stored.coded[0][0].view().data["zero"].astype(mx.float32))
    want = q.reshape(1, 2, t // g, g, 128) * s[:, :, :, None] + z[:, :, :, None]
    got = np.array(seg.key_codec.decode(seg.keys))
    np.testing.assert_allclose(got, want.reshape(got.shape), rtol=1e-5, atol=1e-5)
    # the pair's codes are counted once, by its lower layer
    codes = sum(s.nbytes for s in low.group.codes)
    assert low.nbytes - up.nbytes >= codes > 0
    assert sum(c.nbytes for c in caches) == sum(
        a.nbytes for c in caches for s in c._stores() for a in s.arrays()
    )


def test_the_higher_layers_scales_are_its_own_min_max_calibrated():
    """The higher layer's scale and zero come from its own keys (KIVI's per-channel ranges),
    calibrated, not from the lower layer's."""
    k0, v0 = kv_data(t=256, seed=1)
    k1, v1 = kv_data(t=256, seed=2)
    low, up = (XQuantCache(bits=2, window=0) for _ in range(2))
    for i, c in enumerate((low, up)):
        c.layer = i
        c._link("kv")
    XQuantPair([low, up])
    low.update_and_fetch(k0, v0)
    up.update_and_fetch(k1, v1)
    alone = XQuantCache(bits=2, window=0)
    alone.update_and_fetch(k1, v1)
    for i in (0, 1):
        for n in ("scale", "zero"):
            a = up.stored.coded[0][i].view().data[n]
            b = alone.stored.coded[0][i].view().data[n]
            assert mx.array_equal(a, b).item(), (i, n)
    # its reconstruction: the lower layer's codes, so worse than its own codes
    err_pair = rel_error(up.keys_and_values()[0], k1)
    err_alone = rel_error(alone.keys_and_values()[0], k1)
    assert err_pair > err_alone


def _linked_pair(spec_kw: dict, t: int = 256):
    """Two caches paired by hand (layers 0 and 1), fed different keys and values."""
    low, up = (XQuantCache(**spec_kw) for _ in range(2))
    for i, c in enumerate((low, up)):
        c.layer = i
        c._link("kv")
    XQuantPair([low, up])
    for c, seed in ((low, 1), (up, 2)):
        k, v = kv_data(t=t, seed=seed)
        c.update_and_fetch(k, v)
    return low, up


def test_bytes_of_a_pair_are_the_codes_once_and_each_layers_scales():
    """2 heads, 1,000 tokens, head dim 128, 2-bit codes in groups of 32, no window: 992 tokens
    coded (31 key groups), 8 waiting in fp16. The lower layer holds the pair's codes and its
    scales (2 + 1 bits an entry), the higher layer its scales alone (1 bit an entry)."""
    low, up = _linked_pair({"bits": 2, "window": 0}, t=1000)
    assert [s.tokens for s in up.segments()] == [992, 8]
    codes = 992 * 2 * 128 * 2 // 8  # a side's codes, once a pair
    key_scales = 31 * 2 * 128 * 2 * 2  # a scale and a zero a channel and 32-token group
    value_scales = 992 * 2 * (128 // 32) * 2 * 2  # a scale and a zero a 32-channel group
    fp16 = 8 * 2 * 128 * 2 * 2
    assert low.logical_nbytes == 2 * codes + key_scales + value_scales + fp16 == 198_656
    assert up.logical_nbytes == key_scales + value_scales + fp16 == 71_680
    entries = 992 * 2 * 128
    assert (key_scales + codes) * 8 / entries == 3.0 and key_scales * 8 / entries == 1.0


emulated_gpu = emulated_gpu_fixture()


@needs_gxx
def test_the_decode_kernel_reads_a_pairs_joined_codes(emulated_gpu):
    """On a GPU the higher layer's coded segment (the lower layer's one-bit codes, its own
    calibrated scales) goes through velox-core's fused decode kernel as affine codes (keys per
    channel, values per token; the kernels emulated on the CPU: about half a minute to build)
    and equals the reference partial."""
    _, up = _linked_pair({"bits": 1, "window": 0})
    seg = next(s for s in up.segments() if "codes" in s.keys.data)
    q = mx.random.normal((1, 2, 4, 128), key=mx.random.key(1)) * 0.3
    assert_kernel_partial(
        emulated_gpu, q, seg.key_codec, seg.keys, seg.value_codec, seg.values, 1e-4
    )


def test_on_the_cpu_the_kernels_decline_and_the_reference_path_reads_the_codes():
    _, up = _linked_pair({"bits": 2, "window": 0})
    seg = next(s for s in up.segments() if "codes" in s.keys.data)
    assert_cpu_declines(seg.key_codec, seg.keys, seg.value_codec, seg.values)


def test_a_higher_layer_updated_before_its_lower_layer_is_refused():
    model = _model(2)
    _, up = make_cache(model, "xquant:bits=2,window=0")
    k, v = kv_data(t=128)
    with pytest.raises(ValueError, match="the lower layer first"):
        up.update_and_fetch(k, v)


def test_pairs_need_the_same_widths_groups_and_windows():
    with pytest.raises(ValueError, match="differ: key codes of 2 / 1 bits"):
        make_cache(_model(2), "xquant:bits=2", layers={1: "xquant:bits=1,value_bits=2"})
    with pytest.raises(ValueError, match="window 128 / 0"):
        make_cache(_model(2), "xquant", layers={1: "xquant:window=0"})
    with pytest.raises(ValueError, match="whose cache is UniformCache"):
        make_cache(_model(2), "xquant", layers={0: "uniform"})
    # a lower neighbour that keeps the model's own cache leaves the layer unpaired
    caches = make_cache(_model(2), "xquant", layers={0: "fp16"})
    assert caches[1].group is None and caches[1].shared == ""
    # widths of a side the pair does not share may differ
    caches = make_cache(_model(2), "xquant:share=k", layers={1: "xquant:share=k,value_bits=1"})
    assert caches[1].group is caches[0].group


def test_the_pairs_decode_as_in_a_model_routed_or_not():
    model = _model(2)
    prompt = mx.random.randint(0, 512, (1, 300), key=mx.random.key(4))
    logits = []
    for on in (True, False):
        caches = make_cache(model, "xquant:bits=2")
        if on:
            with routed(model):
                model(prompt, cache=caches)
                logits.append(model(mx.array([[7]]), cache=caches))
        else:
            model(prompt, cache=caches)
            logits.append(model(mx.array([[7]]), cache=caches))
    assert rel_error(logits[0], logits[1]) < 2e-2


def test_a_batch_prefilled_together_equals_each_row_alone():
    model = _model(2)
    prompt = mx.random.randint(0, 512, (2, 200), key=mx.random.key(3))
    assert_rows_decode_alone(model, "xquant:bits=2,window=16", prompt)


def test_trim_both_layers_into_the_codes_then_continue():
    model = _model(2)
    caches = _prefill(model, make_cache(model, "xquant:bits=2,window=0,group=128"), t=300)
    assert not caches[0].is_trimmable() and not caches[1].is_trimmable()
    assert XQuantCache(bits=2, share_from=None).is_trimmable() is False  # a block codec
    for c in caches:
        c.trim(100)  # 45 window tokens, then 55 coded ones: a key group cut in two
    assert all(c.offset == c.size() == 201 for c in caches)
    assert caches[0].group.codes[0].tokens == 128 == caches[1].stored.coded[0][0].tokens
    with routed(model):
        out = model(mx.random.randint(0, 512, (1, 140), key=mx.random.key(8)), cache=caches)
    assert all(c.offset == 341 for c in caches) and bool(mx.all(mx.isfinite(out)).item())
    assert caches[0].group.codes[0].tokens == 256 == caches[1].stored.coded[0][0].tokens


# -- files and copies ------------------------------------------------------------------------------
def test_save_load_and_deepcopy_of_the_whole_model_keep_the_pairs(tmp_path):
    model = _model(5)  # pairs [0, 1] and [2, 3]; layer 4 alone
    caches = make_cache(model, "xquant:bits=2,window=16,group=32")  # 64 of 122 tokens coded
    for other in assert_linked_copies(model, caches, tmp_path / "x.safetensors", "codes"):
        assert other[0].group is other[1].group is not other[2].group is other[3].group
        assert other[4].group is None and [c.shared for c in other] == [c.shared for c in caches]


def test_a_layer_saved_without_its_pair_is_refused_and_a_copy_holds_the_codes(tmp_path):
    model = _model(2)
    caches = _prefill(model, make_cache(model, "xquant:bits=2"))
    save_cache(tmp_path / "one.safetensors", [caches[1]])
    with pytest.raises(ValueError, match="missing"):
        load_cache(tmp_path / "one.safetensors")
    alone = caches[1].copy()  # a copy of one layer holds the pair's codes itself
    assert alone.group.owner is alone and alone.size() == caches[1].size()
    assert rel_error(alone.keys_and_values()[0], caches[1].keys_and_values()[0]) < 1e-6
    k, v = kv_data(t=200, seed=3)
    alone.update_and_fetch(k, v)  # it codes new tokens itself
    assert (
        alone.group.codes[0].tokens
        == alone.stored.coded[0][0].tokens
        > caches[1].stored.coded[0][0].tokens
    )


def test_bad_specs_are_refused_early():
    with pytest.raises(ValueError, match="group=96 must divide the value head dim 128"):
        make_cache(_model(2), "xquant:group=96")
    with pytest.raises(ValueError, match="share must be one of"):
        make("xquant:share=q")
    assert math.isclose(make("xquant:bits=1").tiers[0].value_codec.eta, 1 / 6)
