"""CacheGen caches saved and loaded: the quantizer's values exactly, bytes accounted for,
levels and ladders, caches that keep decoding."""

import mlx.core as mx
import numpy as np
import pytest
from _cg_util import TMP, metas, model, prefilled, prompt, synthetic
from mlx_lm.models.cache import KVCache

import velox_cachegen as cg
from velox_cachegen.chunks import spans
from velox_cachegen.quant import dequantize, quantize, spread_of
from velox_core import make_cache, routed

STEPS = cg.LayerSteps((1.0, 0.5), (2.0, 1.0))


def _sides(caches):
    """Layer-sides ``(B, T, C)`` float32, as the coder reads them."""
    out = []
    for c in caches:
        for a in c.keys_and_values():
            b, h, t, d = a.shape
            out.append(np.array(a.astype(mx.float32)).transpose(0, 2, 1, 3).reshape(b, t, h * d))
    return out


def _expected(caches, step, window, window_step, chunk, steps=STEPS, group=10, delta="auto"):
    """What the quantizer alone gives back for each layer-side (float16, as stored)."""
    sides = _sides(caches)
    mult = steps.sides()
    out = [np.empty_like(s) for s in sides]
    for a, b, is_window in spans(sides[0].shape[1], window, chunk):
        lv = step * (window_step if is_window else 1.0)
        for i, s in enumerate(sides):
            part = s[:, a:b]
            sp = spread_of(part)
            q = quantize(part, lv * mult[i] * sp if sp > 0 else lv * mult[i], 0.5, group, delta)
            out[i][:, a:b] = dequantize(q, 0.5, group)
    return out


def test_a_loaded_cache_holds_exactly_what_the_quantizer_gives():
    caches = prefilled(230)
    kw = dict(step=2.0, window=16, window_step=0.25, chunk=64, layer_steps=STEPS)
    sizes = cg.save(TMP / "exact.cgen", caches, **kw)
    back = cg.load(TMP / "exact.cgen")
    assert [type(c) for c in back] == [KVCache, KVCache] and [c.offset for c in back] == [230, 230]
    assert all(c.keys.dtype == mx.float16 for c in back)
    want = _expected(caches, 2.0, 16, 0.25, 64)
    got = _sides(back)
    assert all(
        np.array_equal(w.astype(np.float16), g.astype(np.float16)) for w, g in zip(want, got)
    )
    assert [m["start"] for m, _ in metas((TMP / "exact.cgen").read_bytes())] == [
        0,
        64,
        128,
        192,
        214,
    ]
    assert sizes.total == (TMP / "exact.cgen").stat().st_size


def test_errors_stay_within_half_a_step_and_the_window_is_finer():
    caches = prefilled(300, seed=3)
    data = cg.encode(caches, step=2.0, window=32, window_step=0.125, chunk=128, layer_steps=STEPS)
    back = cg.decode(data)
    steps = [np.frombuffer(sec["steps"], "<f4") for _, sec in metas(data)]
    for i, (x, y) in enumerate(zip(_sides(caches), _sides(back))):
        for (a, b, _), st in zip(spans(300, 32, 128), steps):
            err = np.abs(x[:, a:b] - y[:, a:b]).max()
            # half a step, plus float16 rounding of the stored values
            assert err <= st[i] / 2 + 2e-3 * np.abs(x[:, a:b]).max(), (i, a, err, st[i])
        body = np.abs(x[:, :268] - y[:, :268]).mean()
        window = np.abs(x[:, 268:] - y[:, 268:]).mean()
        assert window < body / 3


def test_bytes_are_accounted_for_and_a_coarser_level_is_smaller_and_less_exact():
    caches = prefilled(256, seed=9)
    fp16 = 2 * sum(c.keys.size + c.values.size for c in caches)
    sizes, errs = [], []
    for step in (1.0, 2.0, 4.0):
        s = cg.save(TMP / f"s{step}.cgen", caches, step=step, layer_steps=STEPS, window=0)
        assert s.total == s.header + s.side + s.tables + s.streams
        assert s.fp16 == fp16 and s.total == (TMP / f"s{step}.cgen").stat().st_size
        info = cg.inspect(TMP / f"s{step}.cgen")
        assert info["bytes"]["tables"] == s.tables and info["bytes"]["streams"] == s.streams
        back = cg.load(TMP / f"s{step}.cgen")
        sizes.append(s.total)
        errs.append(
            sum(float(np.square(x - y).mean()) for x, y in zip(_sides(caches), _sides(back)))
        )
    assert sizes[0] > sizes[1] > sizes[2] and errs[0] < errs[1] < errs[2]
    assert fp16 / sizes[1] > 3


def test_delta_coding_follows_the_tokens_locality():
    walk, noise = synthetic(400), synthetic(400, walk=False)
    kw = dict(step=0.5, window=0, chunk=200, layer_steps=cg.LayerSteps((1.0, 1.0), (1.0, 1.0)))

    def flags(data):
        return np.concatenate(
            [np.unpackbits(np.frombuffer(s["delta"], np.uint8)) for _, s in metas(data)]
        )

    auto = cg.encode(walk, delta="auto", **kw)
    plain = cg.encode(walk, delta="none", **kw)
    anchor = cg.encode(walk, delta="anchor", **kw)
    assert flags(auto).mean() > 0.9 and not flags(plain).any() and flags(anchor).all()
    assert len(auto) < 0.8 * len(plain)
    # tokens without locality: deltas would double the variance, so auto codes them plainly
    assert flags(cg.encode(noise, delta="auto", **kw)).mean() < 0.1
    for data in (auto, plain, anchor):
        back = cg.decode(data)
        assert all(np.abs(x - y).max() < 0.5 for x, y in zip(_sides(walk), _sides(back)))


@pytest.mark.parametrize("dtype", [mx.float16, mx.bfloat16, mx.float32])
def test_batches_and_dtypes_round_trip(dtype):
    caches = prefilled(90, batch=2, dtype=dtype)
    back = cg.decode(cg.encode(caches, step=1.0, chunk=40, window=8, layer_steps=STEPS))
    assert all(c.keys.dtype == dtype for c in back)
    assert all(c.keys_and_values()[0].shape == (2, 2, 90, 32) for c in back)
    want = _expected(caches, 1.0, 8, cg.WINDOW_STEP, 40)
    for w, y in zip(want, _sides(back)):
        w = np.array(mx.array(w.astype(np.float32)).astype(dtype).astype(mx.float32))
        assert np.array_equal(w, y)


def test_loaded_caches_continue_decoding():
    m = model()
    ids = prompt(161)
    caches = [KVCache() for _ in m.layers]
    m(ids[:, :160], cache=caches)
    kl = []
    for step in (0.05, 0.5):
        data = cg.encode(caches, step=step, layer_steps=STEPS, chunk=64, window=16)
        back = cg.decode(data)
        got = m(ids[:, 160:], cache=back)[0, -1].astype(mx.float32)
        assert back[0].offset == 161
        kl.append(got)
    ref = m(ids[:, 160:], cache=caches)[0, -1].astype(mx.float32)
    p = mx.softmax(ref)
    kl = [float(mx.sum(p * (mx.log(p) - mx.log(mx.softmax(g))))) for g in kl]
    assert kl[0] < 0.005 and kl[0] < kl[1]


@pytest.mark.parametrize("with_model", [True, False])
def test_a_velox_cache_comes_back_as_its_method_and_decodes(with_model):
    m = model()
    caches = make_cache(m, "uniform:bits=8,group=32")
    with routed(m):
        m(prompt(150), cache=caches)
    data = cg.encode(caches, model=m, layer_steps=STEPS, chunk=64, window=16)
    back = cg.decode(data, model=m if with_model else None)
    assert [type(c) for c in back] == [type(c) for c in caches]
    assert all(c.offset == 150 and c.config() == o.config() for c, o in zip(back, caches))
    with routed(m):
        out = m(prompt(1, seed=11), cache=back)
    assert bool(mx.all(mx.isfinite(out))) and back[0].offset == 151


def test_metadata_and_the_model_check():
    caches = prefilled(60)
    data = cg.encode(caches, model=model(), metadata={"who": "me"}, layer_steps=STEPS)
    _, meta = cg.decode(data, return_metadata=True)
    assert meta == {"who": "me"}
    other = type(model())(model().args)
    with pytest.raises(ValueError, match="another model"):
        cg.decode(data, model=other)


def test_a_ladder_assembles_any_level_per_chunk():
    caches = prefilled(200, seed=4)
    ladder = cg.encode_levels(
        caches, levels=(1.0, 2.0, 4.0), chunk=64, window=16, layer_steps=STEPS
    )
    sizes = ladder.sizes
    assert sizes.shape == (3, 4) and np.all(np.diff(sizes, axis=0) < 0)
    mixed = ladder.assemble([0, 2, 1, 0])
    assert [m["level"] for m, _ in metas(mixed)] == [1.0, 4.0, 2.0, 0.125]
    back = cg.decode(mixed)
    alone = cg.decode(ladder.assemble([2, 2, 2, 2]))
    x, y, z = _sides(caches)[0], _sides(back)[0], _sides(alone)[0]
    assert np.abs(x[:, :64] - y[:, :64]).mean() < np.abs(x[:, :64] - z[:, :64]).mean()
    assert np.array_equal(y[:, 64:128], z[:, 64:128])  # the same level gives the same chunk
    with pytest.raises(ValueError, match="level index"):
        ladder.assemble([0, 1, 3, 0])
    with pytest.raises(ValueError, match="level index"):
        ladder.assemble([0, 1])


def test_choose_levels_spends_the_deadline():
    sizes = np.array([[400, 400, 400], [200, 200, 200], [100, 100, 100]])
    fast = cg.choose_levels(sizes, deadline=1.0, bandwidth=[10_000] * 3)
    assert fast.choices == [0, 0, 0] and fast.met
    slow = cg.choose_levels(sizes, deadline=1.0, bandwidth=[300, 300, 300])
    assert slow.choices == [2, 2, 2] and slow.met
    # the throughput drops from the second chunk on: the sender sees it once that chunk is
    # sent (the estimate is the chunk before's) and sends the last one coarsest
    drop = cg.choose_levels(sizes, deadline=2.0, bandwidth=[1200, 350, 350])
    assert drop.choices == [0, 0, 2] and drop.met
    hopeless = cg.choose_levels(sizes, deadline=0.1, bandwidth=[100, 100, 100])
    assert hopeless.choices == [2, 2, 2] and not hopeless.met
    with pytest.raises(ValueError, match="bandwidth"):
        cg.choose_levels(sizes, 1.0, [1, 0, 1])
    with pytest.raises(ValueError, match="deadline"):
        cg.choose_levels(sizes, 0, [1, 1, 1])
