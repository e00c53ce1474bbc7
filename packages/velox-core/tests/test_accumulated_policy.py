"""AccumulatedPolicy (velox-h2o's and velox-keyformer's base): the scores follow the stored
tokens, a cut keeps the recent tokens and the top-scored rest, and the hooks' contract."""

import mlx.core as mx
import numpy as np
import pytest

from velox_core import VeloxCache, routed
from velox_core.policy import AccumulatedPolicy
from velox_core.registry import register

H, R, D, SCALE = 2, 2, 8, 8**-0.5


def weight(pos):
    """The vote a query gives the token at ``pos`` in KV head ``h``: ``(h, T)``, positive,
    different per head (so the heads keep different tokens)."""
    pos = np.asarray(pos)
    return np.stack([1.0 + (pos * 7) % 11, 1.0 + (pos * 5) % 13]).astype(np.float32)


@register
class Known(AccumulatedPolicy):
    """Each query votes ``weight(token)`` for every token it can see; records the hooks."""

    name = "known-test"

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.calls: list[int] = []  # begin's n
        self.blocks: list[int] = []  # each block's query count

    def begin(self, n):
        self.calls.append(n)

    def votes(self, queries, q_pos, keys, k_pos, scale):
        self.blocks.append(queries.shape[2])
        kp = np.array(k_pos[0])  # each head its own tokens
        w = mx.array(np.stack([weight(kp[h])[h] for h in range(H)]))[None]  # (1, H, S)
        sees = (k_pos[:, :, None, :] <= q_pos[None, None, :, None]).astype(mx.float32)
        return mx.sum(sees, axis=2) * w


def feed(cache, s, e, b=1):
    """Store positions ``[s, e)`` and attend them with one query each (routed)."""
    x = mx.ones((b, H, e - s, D))
    cache.update_and_fetch(x, x)
    cache.attend(mx.ones((b, H * R, e - s, D)), SCALE, mask="causal")


def expected(t):
    """Accumulated scores after queries at every position ``< t``: ``(H, t)``."""
    pos = np.arange(t)
    return weight(pos) * (t - pos)


def body(cache, h=0, row=0):
    return np.array(cache.policy_view.body_positions()[h][row]).tolist()


def test_a_cut_keeps_the_recent_and_the_top_scored_tokens_per_head():
    p = Known(budget=16, recent=4)
    c = VeloxCache(policy=p)
    feed(c, 0, 64)
    assert p.calls == [64] and np.allclose(np.array(p._scores[0]), expected(64))
    feed(c, 64, 65)  # the cut after the prompt chunk, then the decode token
    acc = expected(64)
    for h in range(H):
        top = sorted(np.argsort(-acc[h, :60], kind="stable")[:12].tolist())
        keep = [*top, 60, 61, 62, 63]  # the top 12 of the rest, then the recent 4
        assert body(c, h) == [*keep, 64], h
        # the kept tokens keep their scores, then the decode query's votes are added
        want = np.concatenate([acc[h, keep], [0.0]]) + weight([*keep, 64])[h]
        assert np.allclose(np.array(p._scores[0, h]), want), h
    assert body(c, 0) != body(c, 1)
    assert p.calls == [64, 1] and p._seen == 65


def test_queries_are_scored_in_blocks_and_the_sum_is_unchanged():
    class Small(Known):
        score_elements = 1 * H * R * 50 * 10  # blocks of 10 queries over 50 stored tokens

    whole, split = Known(budget=400), Small(budget=400)
    for p in (whole, split):
        feed(VeloxCache(policy=p), 0, 50)
    assert whole.blocks == [50] and split.blocks == [10] * 5
    assert np.array_equal(np.array(whole._scores), np.array(split._scores))


def test_a_trim_drops_the_trimmed_scores_and_new_tokens_start_at_zero():
    p = Known(budget=400)
    c = VeloxCache(policy=p)
    feed(c, 0, 40)
    c.trim(5)
    assert p._scores.shape[2] == 40  # aligned at the next update
    c.update_and_fetch(mx.ones((1, H, 2, D)), mx.ones((1, H, 2, D)))
    want = np.concatenate([expected(40)[:, :35], np.zeros((H, 2))], axis=1)
    assert np.allclose(np.array(p._scores[0]), want) and p._seen == 35
    # tokens stored without a query rank above every scored one, the newest first
    with routed():
        got = np.array(p.score(c.policy_view)[0][0, 35:])
        assert np.array_equal(got, want[0].max() + np.array([1, 2]))
    with pytest.raises(ValueError, match="known-test: .*routed"):
        p.score(c.policy_view)


def test_batch_rows_filter_and_extend_and_the_state_round_trips():
    p = Known(budget=400)
    c = VeloxCache(policy=p)
    feed(c, 0, 30, b=2)
    one = c.extract(1)
    assert one.policy._scores.shape == (1, H, 30)
    one.extend(c)
    assert one.policy._scores.shape == (3, H, 30)
    assert np.allclose(np.array(one.policy._scores[2]), expected(30))
    short = VeloxCache(policy=Known(budget=400))
    feed(short, 0, 20)
    with pytest.raises(ValueError, match="known-test: extend needs"):
        one.policy.extend_batch(short.policy)
    q = Known(budget=400)
    q.set_state(p.state(), p.meta())
    assert q.meta() == p.meta() == {"chunk_pending": True, "seen": 30}
    assert set(q.state()) == {"scores"} and mx.array_equal(q._scores, p._scores)
    with pytest.raises(ValueError, match=r"known-test: .* float32 \(B, H, S\)"):
        q.set_state({"scores": mx.zeros((2, 30))}, {})
    with pytest.raises(ValueError, match="no array state"):
        q.set_state({**p.state(), "extra": mx.zeros(1)}, {})


def test_the_budget_leaves_room_and_the_votes_are_a_subclass_s():
    with pytest.raises(ValueError, match="at least one top-scored token must fit"):
        VeloxCache(sinks=4, policy=Known(budget=20, recent=16))
    c = VeloxCache(policy=AccumulatedPolicy(budget=16))
    c.update_and_fetch(mx.ones((1, H, 4, D)), mx.ones((1, H, 4, D)))
    with pytest.raises(NotImplementedError, match="accumulated: a subclass gives the votes"):
        c.attend(mx.ones((1, H * R, 4, D)), SCALE, mask="causal")
