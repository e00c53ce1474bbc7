"""QueryWindow (the buffered queries and their weights over the stored tokens) and
WindowVotePolicy (SnapKV-style voting), the pieces velox-snapkv, velox-pyramidkv and
velox-tova build on."""

import mlx.core as mx
import numpy as np
import pytest

from velox_core import RetentionPolicy, VeloxCache, routed
from velox_core.policy import QueryWindow, WindowVotePolicy
from velox_testing import kv_data

D = 16
SCALE = D**-0.5


class EvenFirst(RetentionPolicy):
    """Keeps even positions first: the body has gaps after a cut."""

    name = "even-first-test"

    def score(self, view):
        return [(p % 2 == 0).astype(mx.float32) * 1e6 + p for p in view.body_positions()]


def queries(t, hq=4, b=1, seed=1):
    return mx.random.normal((b, hq, t, D), key=mx.random.key(seed))


def stored(sinks=2, window=4, budget=24, t=60):
    """A cache whose body has gaps: 40 tokens cut to ``budget``, then 20 more stored."""
    k, v = kv_data(t=t, d=D, dtype=mx.float32)
    c = VeloxCache(sinks=sinks, window=window, policy=EvenFirst(budget=budget))
    c.update_and_fetch(k[:, :, :40], v[:, :, :40])
    c.update_and_fetch(k[:, :, 40:], v[:, :, 40:])
    return c, k


def reference_votes(q, q_pos, keys, k_pos, scale, fusion="sum"):
    """numpy: each query's softmax over the keys at or before it, averaged over the query
    heads of each KV head, then summed over the queries (``"max"``: their maximum)."""
    q, keys = np.array(q, dtype=np.float64), np.array(keys, dtype=np.float64)
    h = keys.shape[1]
    r = q.shape[1] // h
    per_query = np.zeros((q.shape[0], h, len(q_pos), keys.shape[2]))
    for b in range(q.shape[0]):
        for j in range(q.shape[1]):
            for i, p in enumerate(q_pos):
                s = keys[b, j // r] @ q[b, j, i] * scale
                s = np.where(k_pos[b, j // r] <= p, s, -np.inf)
                w = np.exp(s - s.max())
                per_query[b, j // r, i] += w / w.sum() / r
    return per_query.max(axis=2) if fusion == "max" else per_query.sum(axis=2)


def test_votes_are_the_softmax_over_every_stored_token_at_its_position():
    c, _ = stored()
    body_pos = mx.stack(c.policy_view.body_positions(), axis=1)
    assert np.diff(np.array(body_pos[0, 0])).max() > 1  # gaps: positions, not slots
    q = queries(6)
    w = QueryWindow(4)
    w.add(c.policy_view, q, SCALE)  # the newest 4: positions 56..59
    assert w.end == 60 and w.queries.shape == (1, 4, 4, D)
    got = np.array(w.votes(c.policy_view, body_pos))
    keys, _ = c.keys_and_values()
    n_sink, t = c.policy_view.sink_count(), body_pos.shape[2]
    n_win = keys.shape[2] - n_sink - t
    k_pos = np.concatenate(
        [
            np.broadcast_to(np.arange(n_sink), (1, 2, n_sink)),
            np.array(body_pos),
            np.broadcast_to(np.arange(60 - n_win, 60), (1, 2, n_win)),
        ],
        axis=2,
    )
    want = reference_votes(q[:, :, 2:], range(56, 60), keys, k_pos, SCALE)
    assert got.shape == (1, 2, t)
    np.testing.assert_allclose(got, want[:, :, n_sink : n_sink + t], rtol=1e-4, atol=1e-6)
    # MorphKV's max fusion: the largest head-averaged weight any one query gives
    got = np.array(w.votes(c.policy_view, body_pos, fusion="max"))
    want_max = reference_votes(q[:, :, 2:], range(56, 60), keys, k_pos, SCALE, "max")
    np.testing.assert_allclose(got, want_max[:, :, n_sink : n_sink + t], rtol=1e-4, atol=1e-6)
    with pytest.raises(ValueError, match="fusion"):
        w.votes(c.policy_view, body_pos, fusion="mean")


def test_add_keeps_the_newest_queries_across_calls_and_drops_trimmed_ones():
    c, _ = stored()  # offset 60
    q = queries(60)
    w = QueryWindow(8)
    c.offset = 50
    w.add(c.policy_view, q[:, :, 45:50], SCALE)
    c.offset = 53
    w.add(c.policy_view, q[:, :, 50:53], SCALE)
    assert w.end == 53 and mx.array_equal(w.queries, q[:, :, 45:53])
    c.offset = 51  # 51, 52 trimmed away, then stored again
    w.add(c.policy_view, q[:, :, 49:51], SCALE)
    assert w.end == 51 and mx.array_equal(w.queries, q[:, :, 45:51])
    c.offset = 60  # a gap after the buffer: start over
    w.add(c.policy_view, q[:, :, 57:60], SCALE)
    assert mx.array_equal(w.queries, q[:, :, 57:60])
    c.offset = 61  # another head layout: start over
    w.add(c.policy_view, queries(1, hq=2), SCALE)
    assert w.queries.shape == (1, 2, 1, D)
    c.offset = 58  # every buffered query trimmed: none votes
    assert w.votes(c.policy_view, mx.stack(c.policy_view.body_positions(), axis=1)) is None


def test_batch_rows_and_state():
    c, _ = stored()
    q = queries(4, b=2)
    a, b = QueryWindow(4), QueryWindow(4)
    a.add(c.policy_view, q, SCALE)
    b.add(c.policy_view, q[::-1], SCALE)
    a.extend_batch(b)
    assert a.queries.shape[0] == 4 and mx.array_equal(a.queries[2:], q[::-1])
    a.filter_batch(mx.array([3]))
    assert mx.array_equal(a.queries, q[:1])
    b.end += 1  # other positions: cannot be joined
    a.extend_batch(b)
    assert a.queries is None and a.state() == {}
    assert b.state("query").keys() == {"query"} and b.meta() == {"q_end": 61, "scale": SCALE}
    fresh = QueryWindow(4)
    fresh.set_state(b.queries, b.meta())
    assert fresh.end == 61 and fresh.scale == SCALE and fresh.queries is b.queries
    fresh.set_state(None, None)
    assert (fresh.queries, fresh.end, fresh.scale) == (None, 0, None)
    with pytest.raises(ValueError, match="n <= 4"):
        fresh.set_state(queries(5), {})


def test_window_vote_policy_keeps_what_the_window_attends_to():
    k, v = kv_data(t=100, d=D, dtype=mx.float32)
    k = mx.concatenate([k[:, :, :30], 20 * k[:, :, 30:31], k[:, :, 31:]], axis=2)  # token 30
    q = mx.repeat(k[:, :, 30:31], 2, axis=1) * mx.ones((1, 1, 100, 1))  # every query looks at 30
    p = WindowVotePolicy(budget=20, observe=8, kernel=1)
    c = VeloxCache(policy=p)
    with pytest.raises(ValueError, match="routed"):
        c.update_and_fetch(k[:, :, :99], v[:, :, :99])
        c.update_and_fetch(k[:, :, 99:], v[:, :, 99:])
    c = VeloxCache(policy=WindowVotePolicy(budget=20, observe=8, kernel=1))
    c.update_and_fetch(k[:, :, :99], v[:, :, :99])
    c.attend(q[:, :, :99], SCALE, mask="causal")
    assert c.policy.state()["queries"].shape == (1, 4, 8, D)
    c.update_and_fetch(k[:, :, 99:], v[:, :, 99:])
    pos = set(np.array(c.policy_view.body_positions()[0][0]).tolist())
    assert 30 in pos and set(range(91, 100)) <= pos and len(pos) == 21
    assert c.policy.state() == {}  # every=None: the queries voted once and are dropped
    assert c.policy.meta() == {"chunk_pending": False, "q_end": 99, "scale": SCALE}
    with routed():  # routed, no query yet: the most recent tokens
        c = VeloxCache(policy=WindowVotePolicy(budget=20, observe=8))
        c.update_and_fetch(k[:, :, :99], v[:, :, :99])
        c.update_and_fetch(k[:, :, 99:], v[:, :, 99:])
    assert set(np.array(c.policy_view.body_positions()[0][0]).tolist()) == set(
        range(79, 100)
    )  # 20, then 99
