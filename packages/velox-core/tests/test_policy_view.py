"""The policy contract: a retention policy sees its cache only through ``PolicyView``, whose
members are exactly the documented ones, and a policy written against the view alone works
through prefill, decode, save/load and batching."""

import inspect

import mlx.core as mx
import numpy as np
import pytest

from velox_core import RetentionPolicy, VeloxCache, load_cache, routed, save_cache
from velox_core.policy.view import PolicyView, Tokens
from velox_core.registry import register

# the contract (docs/architecture.md, "Retention"): counts, tokens, layout, actions
MEMBERS = {
    "offset", "sinks", "window", "size", "body_sizes", "sink_count", "protected_count",
    "body_keys", "body_values", "body_positions", "protected", "keys_and_values", "segments",
    "batch", "kv_heads", "key_dim", "value_dim", "dtype", "codecs", "ragged", "routed",
    "evict", "set_body_values",
}  # fmt: skip
H, D, SINKS, WINDOW, BUDGET = 2, 16, 2, 4, 16


@register
class KeyNormViewTest(RetentionPolicy):
    """Keeps the body tokens whose keys have the largest norm, per KV head; counts the
    queries it observed (saved in its meta). Every hook checks it was given a view."""

    name = "keynorm-view-test"

    def __init__(self, budget=None, every=None):
        super().__init__(budget, every)
        self.queries = 0

    def attach(self, view):
        assert type(view) is PolicyView
        super().attach(view)

    def observe(self, view, queries, scale):
        assert type(view) is PolicyView and view.routed in (True, False)
        self.queries += queries.shape[2]

    def before_update(self, view, incoming):
        assert type(view) is PolicyView
        super().before_update(view, incoming)

    def score(self, view):
        assert type(view) is PolicyView
        sinks, window = view.protected()
        assert sinks.positions.shape == (view.sink_count(),)
        assert view.sink_count() + window.positions.shape[0] == view.protected_count()
        return [None if k is None else mx.linalg.norm(k[:, 0], axis=-1) for k in view.body_keys()]

    def meta(self):
        return {**super().meta(), "queries": self.queries}

    def set_state(self, state, meta):
        super().set_state(state, meta)
        self.queries = int((meta or {}).get("queries", 0))


def data(t, b=1, seed=0):
    k = mx.random.normal((b, H, t, D), key=mx.random.key(seed)).astype(mx.float16)
    v = mx.random.normal((b, H, t, D), key=mx.random.key(seed + 1)).astype(mx.float16)
    q = mx.random.normal((b, 2 * H, t, D), key=mx.random.key(seed + 2)).astype(mx.float16)
    return k, v, q


def step(c, k, v, q, s, e):
    c.update_and_fetch(k[:, :, s:e], v[:, :, s:e])
    return c.attend(q[:, :, s:e], D**-0.5, mask="causal" if e - s > 1 else None)


def cut_after_prefill(k, t):
    """Per row and head, the body positions after a prompt of ``t`` tokens and one decode
    step: the first decode update cuts the body (positions ``SINKS .. t - WINDOW - 1``) to
    its largest key norms, then position ``t - WINDOW`` leaves the window for the body."""
    norms = np.linalg.norm(np.array(k.astype(mx.float32)), axis=-1)  # (B, H, T)
    keep = BUDGET - SINKS - WINDOW
    out = []
    for row in norms:
        heads = []
        for n in row:
            body = np.arange(SINKS, t - WINDOW)
            top = body[np.argsort(-n[body], kind="stable")[:keep]]
            heads.append([*sorted(top.tolist()), t - WINDOW])
        out.append(heads)
    return out


def body(c):
    """A one-row cache's body positions, per KV head."""
    return [np.array(p[0]).tolist() for p in c.policy_view.body_positions()]


def test_the_view_has_exactly_the_documented_members_and_no_way_to_the_cache():
    c = VeloxCache(window=WINDOW, sinks=SINKS, policy=KeyNormViewTest(budget=BUDGET))
    view = c.policy_view
    assert type(view) is PolicyView and c.policy_view is view  # made once, by the cache
    public = {n for n in dir(view) if not n.startswith("_")}
    assert public == MEMBERS
    assert not hasattr(view, "__dict__") and PolicyView.__slots__ == ("_cache",)
    for name in ("stored", "policy", "tiers", "update_and_fetch", "attend", "_planned"):
        with pytest.raises(AttributeError):
            getattr(view, name)
    with pytest.raises(AttributeError):
        view.stored = None  # no attribute can be added to reach anything else
    for name in MEMBERS:  # each documented (Google style: shapes or types stated)
        doc = inspect.getdoc(getattr(PolicyView, name))
        assert doc and len(doc) > 30, name
    # before the first token: the layout is unknown, the counts are zero
    assert (view.batch, view.kv_heads, view.key_dim, view.value_dim, view.dtype) == (None,) * 5
    assert (view.offset, view.sinks, view.window, view.size()) == (0, SINKS, WINDOW, 0)
    assert view.body_sizes() == [] and not view.ragged and not view.routed


def test_the_view_reads_what_the_cache_stores():
    c = VeloxCache(window=WINDOW, sinks=SINKS, policy=KeyNormViewTest(budget=BUDGET))
    k, v, q = data(40)
    step(c, k, v, q, 0, 40)
    view = c.policy_view
    assert (view.batch, view.kv_heads, view.key_dim, view.value_dim) == (1, H, D, D)
    assert view.dtype == mx.float16 and view.offset == 40 and view.size() == 40
    assert view.body_sizes() == [40 - SINKS - WINDOW] * H and view.protected_count() == 6
    sinks, window = view.protected()
    assert isinstance(sinks, Tokens) and sinks.positions.tolist() == [0, 1]
    assert window.positions.tolist() == [36, 37, 38, 39]
    assert mx.array_equal(sinks.keys, k[:, :, :SINKS])
    assert mx.array_equal(window.values, v[:, :, 36:])
    keys, values = view.keys_and_values()
    assert mx.array_equal(keys, k) and mx.array_equal(values, v)
    bk, bv, bp = view.body_keys(), view.body_values(), view.body_positions()
    assert bk[1].shape == (1, 1, 34, D) and bk[1].dtype == view.dtype  # kept as given
    assert mx.array_equal(bv[0][:, 0], v[:, 0, SINKS:36].astype(mx.float32))
    assert bp[0].dtype == mx.int32 and bp[0].tolist() == [list(range(SINKS, 36))]
    first = view.body_values(stop=5)  # each head's first 5 tokens alone
    assert all(mx.array_equal(a, b[:, :, :5]) for a, b in zip(first, bv))
    assert [x.shape[2] for x in view.body_values(stop=100)] == [34, 34]
    assert [s.tokens for s in view.segments()] == [SINKS, 34, WINDOW]
    assert view.codecs == (c.tiers[0].key_codec, c.tiers[0].value_codec)
    # the actions: evict keeps the named body tokens; set_body_values rewrites values
    view.evict(mx.array([0, 5, 7], dtype=mx.int32))
    assert view.body_positions()[0].tolist() == [[2, 7, 9]] and c.size() == 9
    view.set_body_values(1, mx.zeros((1, H, 2, D)))
    assert mx.array_equal(view.body_values()[1][:, 0, 1:], mx.zeros((1, 2, D)))
    with pytest.raises(ValueError, match="set_body_values"):
        view.set_body_values(2, mx.zeros((1, H, 2, D)))


def test_a_view_only_policy_through_prefill_decode_save_load_and_batching(tmp_path):
    k, v, q = data(48, b=2, seed=3)
    caches = []
    for r in range(2):  # one sequence each: prefill 40 tokens, then decode 8
        c = VeloxCache(window=WINDOW, sinks=SINKS, policy=KeyNormViewTest(budget=BUDGET))
        kr, vr, qr = k[r : r + 1], v[r : r + 1], q[r : r + 1]
        step(c, kr, vr, qr, 0, 40)
        assert c.size() == 40  # a chunk is cut at the next update
        step(c, kr, vr, qr, 40, 41)
        assert body(c) == cut_after_prefill(kr[:, :, :40], 40)[0]
        assert c.size() == BUDGET + 1 and c.policy.queries == 41
        caches.append(c)
    # save/load: the loaded cache holds the same tokens and policy state, and goes on alike
    path = tmp_path / "view.safetensors"
    save_cache(path, caches[:1])
    (d,) = load_cache(path)
    assert type(d.policy) is KeyNormViewTest and d.policy.queries == 41
    assert body(d) == body(caches[0]) and d.policy_view is not caches[0].policy_view
    k0, v0, q0 = k[:1], v[:1], q[:1]
    assert mx.array_equal(step(d, k0, v0, q0, 41, 42), step(caches[0], k0, v0, q0, 41, 42))
    # batching: two rows in one cache cut each row by its own scores, as alone
    rows = []
    for r in range(2):
        c = VeloxCache(window=WINDOW, sinks=SINKS, policy=KeyNormViewTest(budget=BUDGET))
        c.update_and_fetch(k[r : r + 1, :, :40], v[r : r + 1, :, :40])
        rows.append(c)
    batch = VeloxCache.merge(rows)
    assert batch.rows == [2]
    with routed():
        batch.update_and_fetch(k[:, :, 40:41], v[:, :, 40:41])
        batch.attend(q[:, :, 40:41], D**-0.5)
    want = cut_after_prefill(k[:, :, :40], 40)
    for r in range(2):
        one = batch.extract(r)
        assert body(one) == want[r] and one.size() == BUDGET + 1


def test_joined_arrays_are_the_heads_arrays_joined():
    """``joined=True`` gives every head's body in one array, the per-head arrays stacked
    (positions) or concatenated (values, ``stop`` too), None while the body is empty; a ragged
    body joins where its heads hold as many tokens and refuses where they do not."""
    c = VeloxCache(window=WINDOW, sinks=SINKS, policy=KeyNormViewTest(budget=BUDGET))
    view = c.policy_view
    k, v, _ = data(40)
    c.update_and_fetch(k[:, :, : SINKS + WINDOW], v[:, :, : SINKS + WINDOW])  # no body yet
    assert view.body_sizes() == [0, 0]
    assert view.body_positions(joined=True) is None and view.body_values(joined=True) is None
    c.update_and_fetch(k[:, :, SINKS + WINDOW :], v[:, :, SINKS + WINDOW :])
    pos = view.body_positions(joined=True)
    assert pos.dtype == mx.int32 and pos.shape == (1, H, 40 - SINKS - WINDOW)
    assert mx.array_equal(pos, mx.stack(view.body_positions(), axis=1))
    for stop in (None, 5):
        got = view.body_values(stop=stop, joined=True)
        assert got.dtype == mx.float32
        assert mx.array_equal(got, mx.concatenate(view.body_values(stop=stop), axis=1))
    view.evict([mx.array([0, 3], dtype=mx.int32), mx.array([4, 9], dtype=mx.int32)])
    assert view.ragged and view.body_sizes() == [2, 2]
    assert view.body_positions(joined=True).tolist() == [[[2, 5], [6, 11]]]
    assert mx.array_equal(view.body_values(joined=True), mx.concatenate(view.body_values(), 1))
    view.evict([mx.array([0, 1], dtype=mx.int32), mx.array([1], dtype=mx.int32)])
    for read in (view.body_positions, view.body_values):
        with pytest.raises(ValueError, match="different numbers of body tokens"):
            read(joined=True)


def test_per_head_eviction_through_the_view():
    """A list of index arrays (one per KV head) makes the body ragged; the view still gives
    each head's tokens, values in float32 as documented, and refuses what needs one body."""
    c = VeloxCache(window=WINDOW, sinks=SINKS, policy=KeyNormViewTest(budget=BUDGET))
    k, v, _ = data(40)
    c.update_and_fetch(k, v)
    view = c.policy_view
    view.evict([mx.array([0, 3, 9], dtype=mx.int32), mx.array([4], dtype=mx.int32)])
    assert view.ragged and view.body_sizes() == [3, 1] and view.size() == 9
    assert [p.tolist() for p in view.body_positions()] == [[[2, 5, 11]], [[6]]]
    values = view.body_values()
    assert [x.dtype for x in values] == [mx.float32, mx.float32]
    assert mx.array_equal(values[1][0, 0, 0], v[0, 1, 6].astype(mx.float32))
    assert [x.shape[2] for x in view.body_values(stop=2)] == [2, 1]
    assert view.protected()[1].positions.tolist() == [36, 37, 38, 39]
    for refused in (view.keys_and_values, view.segments):
        with pytest.raises(ValueError, match="per-head"):
            refused()
    with pytest.raises(ValueError, match="set_body_values"):
        view.set_body_values(0, mx.zeros((1, H, 1, D)))
