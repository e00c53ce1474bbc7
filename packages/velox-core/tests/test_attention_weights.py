"""A policy that scores tokens by the attention weights of each call gets them from the call
(``RetentionPolicy.wants_weights`` / ``observe_weights``), not from a second computation;
and a decode cut gathers the kept tokens into buffers of the store's size (``PackedStore.keep``),
which hold ``budget + every`` tokens and no more."""

import mlx.core as mx
import numpy as np
import pytest

from velox_core import VeloxCache, routed
from velox_core.cache.attention import Segment, attend, attend_weights
from velox_core.cache.store import PackedStore
from velox_core.codec.identity import Identity
from velox_core.policy import AccumulatedPolicy, window_votes
from velox_core.policy.votes import fuse_weights
from velox_core.registry import register

H, R, D, SCALE = 2, 3, 16, 16**-0.5


@register
class Weighed(AccumulatedPolicy):
    """Accumulated attention (H2O's rule), its decode votes from the call's weights; counts
    the votes computed beside a call."""

    name = "weighed-test"

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.beside = 0

    def votes(self, queries, q_pos, keys, k_pos, scale):
        self.beside += queries.shape[2]
        return window_votes(queries, q_pos, keys, k_pos, scale)

    def weight_votes(self, weights, q_pos):
        return fuse_weights(weights)


@register
class Beside(Weighed):
    """The same votes, always computed beside the call."""

    name = "beside-test"

    def wants_weights(self, n):
        return False


@register
class Layer50(Weighed):
    """Cuts its layer to 50 tokens, at 50 + ``every`` in decode, under a model budget of 64
    (as SqueezeAttention's layer budgets)."""

    name = "layer50-test"

    def before_update(self, view, incoming):
        self._sync(view)
        over = view.size() - 50
        if over > 0 and (incoming > 1 or over >= self.every):
            view.evict(self.select(view, 50 - view.protected_count()))


def data(t, seed=0):
    k = mx.random.normal((1, H, t, D), key=mx.random.key(seed))
    v = mx.random.normal((1, H, t, D), key=mx.random.key(seed + 1))
    q = mx.random.normal((1, H * R, t, D), key=mx.random.key(seed + 2))
    return k, v, q


def run(cache, k, v, q, prompt, chunk=32):
    """A prompt in chunks, then one decode step per remaining token, routed."""
    outs = []
    with routed():
        for s in range(0, prompt, chunk):
            e = min(s + chunk, prompt)
            cache.update_and_fetch(k[:, :, s:e], v[:, :, s:e])
            cache.attend(q[:, :, s:e], SCALE, mask="causal")
        for i in range(prompt, k.shape[2]):
            cache.update_and_fetch(k[:, :, i : i + 1], v[:, :, i : i + 1])
            outs.append(cache.attend(q[:, :, i : i + 1], SCALE))
    return mx.concatenate(outs, axis=2)


def test_attend_weights_are_the_softmax_attend_mixes():
    """The reference path's output, and weights that are each query's causal softmax over
    every stored token (what window_votes scores beside a call)."""
    k, v, q = data(40)
    ident = Identity()
    segs = [
        Segment(ident, ident.encode(k[:, :, :30]), ident, ident.encode(v[:, :, :30])),
        Segment(ident, ident.encode(k[:, :, 30:]), ident, ident.encode(v[:, :, 30:])),
    ]
    qs = q[:, :, -4:]
    out, w = attend_weights(qs, segs, SCALE, mask="causal")
    assert w.shape == (1, H, R, 4, 40) and w.dtype == mx.float32
    np.testing.assert_allclose(
        np.array(out), np.array(attend(qs, segs, SCALE, "causal")), atol=1e-5
    )
    np.testing.assert_allclose(np.array(w.sum(-1)), 1.0, atol=1e-5)
    assert float(w[0, 0, 0, 0, 37:].max()) == 0.0  # the first query sees positions <= 36
    pos = mx.broadcast_to(mx.arange(40, dtype=mx.int32), (1, H, 40))
    votes = window_votes(qs, mx.arange(36, 40, dtype=mx.int32), k, pos, SCALE)
    np.testing.assert_allclose(np.array(fuse_weights(w)), np.array(votes), atol=1e-5)
    with pytest.raises(ValueError, match="no tokens"):
        attend_weights(qs, [], SCALE)


def test_decode_votes_come_from_the_call_and_equal_those_computed_beside_it():
    k, v, q = data(200, seed=3)
    a = VeloxCache(policy=Weighed(budget=64, recent=8))
    b = VeloxCache(policy=Beside(budget=64, recent=8))
    out_a, out_b = run(a, k, v, q, 120), run(b, k, v, q, 120)
    # prefill chunks (more queries than the reference path takes) are scored beside the
    # call; each of the 80 decode steps only by its own attention
    assert a.policy.beside == 120 and b.policy.beside == 200
    np.testing.assert_allclose(np.array(out_a), np.array(out_b), atol=1e-5)
    np.testing.assert_allclose(np.array(a.policy._scores), np.array(b.policy._scores), atol=1e-4)
    pa, pb = a.policy_view.body_positions(), b.policy_view.body_positions()
    assert all(np.array_equal(np.array(x), np.array(y)) for x, y in zip(pa, pb))


def test_without_routing_or_with_sink_logits_the_votes_are_computed_beside():
    k, v, q = data(70, seed=5)
    c = VeloxCache(policy=Weighed(budget=64, recent=8))
    with routed():
        c.update_and_fetch(k[:, :, :69], v[:, :, :69])
        c.attend(q[:, :, :69], SCALE, mask="causal")
        c.update_and_fetch(k[:, :, 69:], v[:, :, 69:])
        c.attend(q[:, :, 69:], SCALE, sinks=mx.zeros((H * R,)))
    assert c.policy.beside == 70


def test_a_decode_cut_keeps_the_buffers_at_budget_plus_every():
    """Each step's cut gathers the kept tokens into the same buffers, which hold the budget
    plus ``every`` tokens (no growth slack), in place from the first decode cut on."""
    k, v, q = data(300, seed=7)
    for every in (1, 4):
        c = VeloxCache(policy=Weighed(budget=64, every=every, recent=8))
        run(c, k, v, q, 200)
        stores = (*c.stored.coded[0], c.stored.positions)
        assert all(s.capacity == 64 + every for s in stores)
        assert c.size() <= 64 + every
    # the buffers hold what the cut kept plus `every`, not the model's budget: a layer cut
    # to fewer tokens holds no room for the budget's
    c = VeloxCache(policy=Layer50(budget=64, every=2, recent=8))
    run(c, k, v, q, 200)
    assert all(s.capacity == 50 + 2 for s in (*c.stored.coded[0], c.stored.positions))


def test_keep_gathers_into_buffers_of_their_size_up_to_room_and_of_room_past_it():
    ident = Identity()
    x = mx.arange(2 * 3 * 50 * 256, dtype=mx.float32).reshape(2, 3, 50, 256)
    idx = mx.array(np.sort(np.random.default_rng(0).choice(50, (2, 3, 20)), axis=-1))
    want = np.take_along_axis(np.array(x), np.array(idx)[..., None], axis=2)

    s = PackedStore()
    s.append(ident.encode(x))
    cap = s.capacity
    mx.eval(s.arrays())
    mx.synchronize()
    base = mx.get_active_memory()
    mx.reset_peak_memory()
    s.keep(idx, room=cap)  # room for every buffered row: buffers of the same size
    mx.eval(s.arrays())
    mx.synchronize()
    assert (s.tokens, s.capacity) == (20, cap)
    # one gather: the new buffer (and its row indices), no copy of the buffer besides
    assert mx.get_peak_memory() - base < x.nbytes // 50 * cap * 1.25
    np.testing.assert_array_equal(np.array(s.view().data["x"]), want)
    s.append(ident.encode(x[:, :, :3]))  # into the rows freed, no growth
    assert s.capacity == cap
    np.testing.assert_array_equal(np.array(s.view().data["x"][:, :, 20:]), np.array(x[:, :, :3]))

    for room, capacity in ((None, 20), (24, 24)):  # past room: buffers of room tokens
        s = PackedStore()
        s.append(ident.encode(x))
        s.keep(idx, room=room)
        assert (s.tokens, s.capacity) == (20, capacity)
        np.testing.assert_array_equal(np.array(s.view().data["x"]), want)

    s.keep(mx.arange(5))  # one index for every row and head
    np.testing.assert_array_equal(np.array(s.view().data["x"]), want[:, :, :5])
    s.keep(mx.zeros((0,), dtype=mx.int32))
    assert s.tokens == 0 and s.view() is None
