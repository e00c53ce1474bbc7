"""KVSink: the conformance suite, and what is KVSink's own."""

import math

import mlx.core as mx
import numpy as np
import pytest

from velox_core import Uniform, VeloxCache, make, make_cache
from velox_kvsink import METHOD, KVSinkCache, outlier_scores, select_sinks
from velox_testing import CacheConformance, assert_head_dim_refused, feed, kv_data, rel_error
from velox_testing.models import conformance_model

TWO_BIT = METHOD.recommended[1]
PLANTED = {**TWO_BIT, "outlier": 4.0}  # above kv_data's own key-norm spread


def KIVICache(bits: int, group: int, **kw) -> VeloxCache:
    """KIVI's cache as velox-kivi makes it (keys per channel, values per token, both in
    ``group``s), built from velox-core alone: this package's tests install no other method."""
    return VeloxCache(
        Uniform(bits, group, axis="channel"), Uniform(bits, group, axis="token"), **kw
    )


class TestKVSink2(CacheConformance):
    """The recommended 2-bit setting; on kv_data it predicts no sink (no outlier tokens)."""

    max_memory_ratio = 0.27  # as KIVI 2-bit with a 128-token window
    attention_error = 0.9  # 2-bit keys move the peaked logits of kv_data a lot

    bad_settings = (
        ({"outlier": 1.0}, "outlier must be > 1.0"),
        ({"outlier": float("nan")}, "outlier must be a finite number"),
        ({"outlier": float("inf")}, "outlier must be a finite number"),
        ({"outlier": "2"}, "outlier must be a number"),
        ({"max_sinks": -1}, "max_sinks must be >= 0"),
        ({"max_sinks": 2.5}, "max_sinks must be an int"),
        ({"bits": 1}, "bits"),
    )

    def make(self):
        return KVSinkCache(**TWO_BIT)

    def make_precise(self):
        return KVSinkCache(**{**TWO_BIT, "bits": 8})


class TestKVSinkPredicting(CacheConformance):
    """A low threshold, so that kv_data's tokens of largest key norm become sinks in the middle
    of the sequence: every protocol path (trim, state, batches, masks) runs with sinks out of
    temporal order."""

    spec = "kvsink:bits=4,group=32,window=32,outlier=1.3,max_sinks=8"
    precise_spec = "kvsink:bits=8,group=32,window=32,outlier=1.3,max_sinks=8"
    max_memory_ratio = 0.35
    attention_error = 0.15
    same_greedy_tokens = 16

    def test_batch(self):
        """Rows keep the same number of sinks: a row flagging fewer than another keeps its
        next highest-scoring tokens exact too, so it attends a few more exact tokens than its
        single-sequence run (here rel. 0.07 apart, within the 4-bit error); a row taken out
        attends exactly as it did in the batch."""
        k, v = kv_data(b=2, t=140)
        batched = feed(self.make(), k, v)
        sp = batched.sink_positions()
        assert sp.shape[0] == 2 and not np.array_equal(sp[0], sp[1])
        q = mx.random.normal((2, 4, 1, 128), key=mx.random.key(9)).astype(mx.float16)
        out = batched.attend(q, scale=0.1)
        for i in range(2):
            single = feed(self.make(), k[i : i + 1], v[i : i + 1])
            assert rel_error(out[i : i + 1], single.attend(q[i : i + 1], scale=0.1)) < 0.15
        one = batched.extract(1)
        assert rel_error(one.attend(q[1:2], scale=0.1), out[1:2]) < 1e-3


# -- planted sinks ------------------------------------------------------------------------------
SINKS = (37, 70, 101)  # not the first tokens


def planted(t=256, b=1, seed=3):
    """kv_data with sink-like tokens at SINKS: suppressed values (1/20 of their norm) and keys
    of 8 times the norm."""
    k, v = kv_data(b=b, t=t, seed=seed)
    k, v = np.array(k.astype(mx.float32)), np.array(v.astype(mx.float32))
    for p in SINKS:
        k[:, :, p] *= 8.0
        v[:, :, p] *= 0.05
    return mx.array(k).astype(mx.float16), mx.array(v).astype(mx.float16)


def test_predictor_picks_planted_sinks_not_the_first_tokens():
    k, v = planted()
    c = feed(KVSinkCache(**PLANTED), k, v, chunks=(200, 1, 1, 54))
    assert c.sink_positions().tolist() == [list(SINKS)]
    kivi_first = KIVICache(bits=2, group=32, window=128, sinks=3)  # Preserve-First-N
    feed(kivi_first, k, v)
    assert kivi_first.policy_view.sink_count() == 3  # positions 0, 1, 2: misses every planted sink


def test_scores_and_selection():
    nk = np.ones((2, 2, 6))
    nv = np.ones((2, 2, 6))
    nk[0, 1, 4] = 3.0  # a key norm outlier in one head of row 0
    nv[1, 0, 2] = 0.25  # a suppressed value in row 1
    s = outlier_scores(nk, nv, nk, nv)
    assert s[0, 4] == pytest.approx(3.0) and s[1, 2] == pytest.approx(4.0)
    assert np.all(np.delete(s[0], 4) == 1.0)
    picked = select_sinks(s, 2.0, room=8)
    assert picked.tolist() == [[4], [2]]
    assert select_sinks(s, 5.0, room=8) is None
    assert select_sinks(s, 2.0, room=0) is None


def test_batch_rows_keep_their_own_sinks_the_same_number():
    k, v = planted(b=2)
    k2, v2 = kv_data(b=1, t=256, seed=9)
    k = mx.concatenate([k[:1], k2], axis=0)  # row 1 has no planted sink
    v = mx.concatenate([v[:1], v2], axis=0)
    c = feed(KVSinkCache(**PLANTED), k, v, chunks=(256,))
    sp = c.sink_positions()
    assert sp.shape == (2, 3) and sp[0].tolist() == list(SINKS)
    kk, _ = c.keys_and_values()
    for row in range(2):
        for p in sp[row]:
            assert mx.array_equal(kk[row, :, int(p)], k[row, :, int(p)])


# -- exact sinks, ranges without them -------------------------------------------------------------
def _np_quantize(x, bits, group, axis):
    """velox's affine quantizer in numpy: fp16 scale and zero per group, codes against them.

    Shapes: x ``(H, T, D)`` float32; returns decoded float32, scale, zero.
    """
    h, t, d = x.shape
    if axis == "channel":
        g = x.reshape(h, t // group, group, d)
        lo, hi = g.min(axis=2, keepdims=True), g.max(axis=2, keepdims=True)
    else:
        g = x.reshape(h, t, d // group, group)
        lo, hi = g.min(axis=3, keepdims=True), g.max(axis=3, keepdims=True)
    levels = (1 << bits) - 1
    scale = np.maximum((hi - lo) / np.float32(levels), 1e-8).astype(np.float16)
    zero = lo.astype(np.float16)
    s, z = scale.astype(np.float32), zero.astype(np.float32)
    codes = np.clip(np.round((g - z) / s), 0, levels)
    return (codes * s + z).reshape(x.shape), scale, zero


def test_sinks_stored_exactly_and_out_of_the_quantization_ranges():
    k, v = planted(t=131)  # 3 sinks + 128 ordinary tokens: 4 key groups of 32, no window
    c = KVSinkCache(bits=2, group=32, window=0, flush=1, outlier=4.0)
    c.update_and_fetch(k, v)
    assert c.sink_positions().tolist() == [list(SINKS)]
    sinks, body = c.segments()  # nothing waits in a window
    assert sinks.tokens == 3 and body.tokens == 128
    idx = mx.array(list(SINKS))
    # bit-identical fp16 sinks, in the store and in the decoded sequence
    assert sinks.keys.data["x"].dtype == mx.float16
    assert mx.array_equal(sinks.keys.data["x"], mx.take(k, idx, axis=2))
    assert mx.array_equal(sinks.values.data["x"], mx.take(v, idx, axis=2))
    kk, vv = c.keys_and_values()
    assert mx.array_equal(mx.take(kk, idx, axis=2), mx.take(k, idx, axis=2))
    assert mx.array_equal(mx.take(vv, idx, axis=2), mx.take(v, idx, axis=2))
    # the codes are the numpy quantizer's on the ordinary tokens alone
    rest = np.array([i for i in range(131) if i not in SINKS])
    for x, side, axis, codec in (
        (k, "keys", "channel", body.key_codec),
        (v, "values", "token", body.value_codec),
    ):
        ordinary = np.array(x.astype(mx.float32))[0][:, rest]
        want, scale, zero = _np_quantize(ordinary, 2, 32, axis)
        rec = getattr(body, side)
        got_scale = np.array(rec.data["scale"][0])
        assert np.array_equal(got_scale, scale.squeeze(2 if axis == "channel" else 3)), side
        assert np.array_equal(
            np.array(rec.data["zero"][0]), zero.squeeze(2 if axis == "channel" else 3)
        )
        got = np.array(codec.decode(rec)[0])
        assert np.abs(got - want).max() <= 1e-3 * np.abs(want).max(), side
        seq = np.array((kk if side == "keys" else vv).astype(mx.float32))[0][:, rest]
        assert np.abs(seq - want).max() <= 2e-3 * np.abs(want).max(), side  # fp16 decode
    # with a sink inside, its key channel groups would be wider: KIVI's are
    kivi = KIVICache(bits=2, group=32, window=0, flush=1)
    kivi.update_and_fetch(k[:, :, :128], v[:, :, :128])
    wide = np.array(kivi.segments()[0].keys.data["scale"][0, :, 1]).astype(np.float32)  # 32-63
    narrow = np.array(body.keys.data["scale"][0, :, 1]).astype(np.float32)
    assert np.median(wide / narrow) > 1.5  # a sink widens its channel groups about 2x


def test_bytes_are_codes_scales_sinks_and_window():
    k, v = planted(t=256)
    c = feed(KVSinkCache(**PLANTED), k, v, chunks=(200, 1, 1, 54))
    _, body, win = c.segments()
    h, d, n = 2, 128, len(SINKS)
    assert body.tokens + win.tokens + n == 256 and body.tokens == 64
    codes = 2 * body.tokens * h * d * 2 // 8  # 2-bit keys and values
    key_scales = (body.tokens // 32) * h * d * 2 * 2  # fp16 scale + zero per channel group
    value_scales = body.tokens * h * (d // 32) * 2 * 2  # fp16 scale + zero per token group
    sinks = 2 * n * h * d * 2 + n * 4  # fp16 keys and values, int32 positions
    window = 2 * win.tokens * h * d * 2
    assert c.logical_nbytes == codes + key_scales + value_scales + sinks + window
    assert c.nbytes >= c.logical_nbytes


# -- order: sinks are stored apart, attention sees them in place -------------------------------
def test_masked_prefill_sees_sinks_in_place():
    k, v = planted(t=160)
    c = KVSinkCache(**PLANTED)
    c.update_and_fetch(k, v)  # all 160 in the window but the 3 sinks
    kk, vv = c.keys_and_values()
    assert mx.array_equal(kk, k) and mx.array_equal(vv, v)  # fp16 everywhere: exact, in order
    q = mx.random.normal((1, 4, 40, 128), key=mx.random.key(0)).astype(mx.float16)
    scale = 1 / math.sqrt(128)
    ref = mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask="causal")
    assert rel_error(c.attend(q, scale=scale, mask="causal"), ref) < 1e-3


def test_trim_drops_trimmed_sinks():
    k, v = planted(t=256)
    c = feed(KVSinkCache(**PLANTED), k, v)
    c.trim(256 - 80)  # positions 80.. go: sink 101 with them
    assert c.offset == c.size() == 80 and c.sink_positions().tolist() == [[37, 70]]


def test_prediction_off_is_kivi_with_first_sinks():
    k, v = kv_data(t=300)
    a = feed(KVSinkCache(**{**TWO_BIT, "max_sinks": 0, "sinks": 4}), k, v)
    b = feed(KIVICache(bits=2, group=32, window=128, sinks=4), k, v)
    assert a.sink_positions().tolist() == [[0, 1, 2, 3]]
    for x, y in zip(a.keys_and_values(), b.keys_and_values()):
        assert mx.array_equal(x, y)


# -- settings -----------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "spec,match",
    [
        ("kvsink:outlier=nan", "kvsink: outlier must be a finite number, got nan"),
        ("kvsink:outlier=inf", "kvsink: outlier must be a finite number, got inf"),
        ("kvsink:outlier=0.5", "outlier must be > 1.0, got 0.5"),
        ("kvsink:max_sinks=-3", "max_sinks must be >= 0, got -3"),
        ("kvsink:sinks=-1", "sinks must be >= 0"),
        ("kvsink:window=-1", "window must be >= 0"),
        ("kvsink:bits=9", "bits"),
        ("kvsink:nope=1", "method 'kvsink' has no parameter 'nope'; allowed: bits"),
    ],
)
def test_make_cache_refuses_bad_parameters(spec, match):
    with pytest.raises(ValueError, match=match.replace("(", r"\(")):
        make_cache(conformance_model(128), spec)


def test_spec_round_trip():
    c = make("kvsink:bits=2,outlier=3.5,max_sinks=4,sinks=1")
    assert (c.cfg.outlier, c.cfg.max_sinks, c.cfg.sinks) == (3.5, 4, 1)
    assert type(c).from_config(c.config()).config() == c.config()


def test_split_by_heads_refused_pipeline_allowed():
    assert "KV heads" in KVSinkCache.split_refusal({}, by_heads=True, pipelined=False)
    assert KVSinkCache.split_refusal({}, by_heads=False, pipelined=True) == ""


def test_make_cache_refuses_a_head_dim_naming_kvsink_and_its_parameter():
    assert_head_dim_refused(
        "kvsink", "group=32 must divide the value head dim 80", "kvsink:group=16"
    )
