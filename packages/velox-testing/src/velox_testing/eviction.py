"""The conformance suite's bounds for eviction presets (``budget`` tokens per KV head), and
the aids the eviction methods' own tests share.

An eviction method's tests run the suite twice: :class:`FullBudgetConformance` with a budget
above every length the suite stores (nothing is evicted: attention equals fp16's), and
:class:`EvictingConformance` with a small budget (most of the context is evicted: bounded
memory, no fp16 reference over all tokens). Both also check that the class refuses bad values
of the settings eviction presets share (:data:`EVICTION_BAD`; a preset voting with an
observation window adds :data:`VOTE_BAD` to its ``bad_settings``, one with a recent window
:data:`RECENT_BAD`). Subclasses define ``spec`` or ``make``; :class:`Routed` runs every test
of a class under routed attention, for policies that see queries only there;
:class:`DecodeGrowthWarning`, for a policy that evicts at the prompt only by default, checks
the warning of a cache that grows through decode.

The aids:

- data and feeding: keys, values and queries with attention far from uniform
  (:func:`attention_data`: :data:`D` channels a head, attended at :data:`SCALE`), a prefill
  and decode steps that attend as a routed model does (:func:`feed_attending`,
  :func:`decode_attending`), a model's chunked prefill whose first
  chunk is checked against mlx-lm's cache (:func:`prefill_checked`), layer 0 of a tiny
  model (:func:`layer_zero_kv`) and as its policy sees it (:func:`observed_layer_zero`), a
  tiny model's prompt in two chunks and bounded decode steps (:func:`two_chunk_prompt`,
  :func:`decode_bounded`);
- references in NumPy (SnapKV's window votes, torch's 1-d pooling, the state of a policy
  that accumulates attention scores) live in :mod:`velox_testing.references`;
- what a cache holds: :func:`kept_positions` (the body), :func:`stored_positions` (every
  token);
- checks: attention reads the kept tokens alone (:func:`assert_attends_to`), a cut no query
  has voted on needs routing (:func:`assert_cut_needs_routing`), a file keeps the policy
  (:func:`reloaded`) and the reloaded copy cuts as the cache (:func:`assert_resumes_alike`),
  a voting policy refuses bad window settings (:func:`assert_vote_settings_refused`), the
  policy's state has its saved format (:func:`assert_state_format`), batch rows choose
  apart (:func:`batch_rows_apart`), sinks and window hold as given (:func:`composed_cache`),
  and the recommended pair most eviction methods share (:func:`recommended_presets`).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any, ClassVar

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import KVCache

from velox_core import Uniform, VeloxCache, load_cache, make, make_cache, routed, save_cache
from velox_core.cache.eviction import RECOMMENDED, RECOMMENDED_VOTED
from velox_core.policy import base

from .conformance import CacheConformance
from .kv import feed, kv_data, rel_error
from .models import tiny_model
from .refusals import EVICTION_BAD, RECENT_BAD, VOTE_BAD, Refusal

__all__ = [
    "EVICTION_BAD",
    "RECENT_BAD",
    "SCALE",
    "VOTE_BAD",
    "D",
    "DecodeGrowthWarning",
    "EvictingConformance",
    "FullBudgetConformance",
    "Routed",
    "assert_attends_to",
    "assert_cut_needs_routing",
    "assert_resumes_alike",
    "assert_state_format",
    "assert_vote_settings_refused",
    "attention_data",
    "batch_rows_apart",
    "composed_cache",
    "decode_attending",
    "decode_bounded",
    "feed_attending",
    "kept_positions",
    "layer_zero_kv",
    "observed_layer_zero",
    "prefill_checked",
    "recommended_presets",
    "reloaded",
    "stored_positions",
    "two_chunk_prompt",
]


class _Eviction(CacheConformance):
    """The suite for an eviction preset: the shared bad settings include :data:`EVICTION_BAD`."""

    def shared_bad_settings(self, cls: type) -> list[Refusal]:
        return [*super().shared_bad_settings(cls), *EVICTION_BAD]


class FullBudgetConformance(_Eviction):
    """A budget above the suite's lengths: nothing is evicted, attention is fp16's."""

    max_memory_ratio = 1.01  # fp16 tokens plus the body's int32 positions
    attention_error = 5e-3
    model_logit_cosine = 0.9999
    same_greedy_tokens = 32


class EvictingConformance(_Eviction):
    """A small budget: evicting, lossy, bounded."""

    max_memory_ratio = 0.1  # measured right after a 512-token chunk: budget + chunk are held
    attention_error = None  # most of the context is evicted: no fp16 reference applies
    model_logit_cosine = 0.5


class Routed:
    """Mixin: every test of the class runs inside ``velox_core.routed()`` (a policy that
    votes with the queries sees them only through velox attention)."""

    @pytest.fixture(autouse=True)
    def _routed(self):
        with routed():
            yield


_BUDGET = 128  # DecodeGrowthWarning's budget

D = 64  # the head dim of attention_data's keys, values and queries
SCALE = D**-0.5  # their attention scale


def _decode_warnings(cache, steps: int) -> list[warnings.WarningMessage]:
    """UserWarnings of a 40-token prompt (under the budget: nothing to evict) then ``steps``
    single-token decode updates, routed (per-head budgets need the queries)."""
    k, v = kv_data(t=40 + steps)
    base._WARNED.discard(cache.policy.name)
    with warnings.catch_warnings(record=True) as seen, routed():
        warnings.simplefilter("always")
        feed(cache, k, v, (40, *([1] * steps)))
    return [w for w in seen if issubclass(w.category, UserWarning)]


class DecodeGrowthWarning:
    """Subclass in a test module and set ``cache``: a cache class taking ``budget`` and
    ``every`` whose defaults (no ``every``) evict at the prompt only. Its cache grows through
    decode without bound, and warns once per policy class and process when it holds twice its
    budget (128 tokens here), naming ``every``."""

    cache: ClassVar[type]

    def test_unbounded_decode_warns_once_naming_every(self):
        c = self.cache(budget=_BUDGET)
        seen = _decode_warnings(c, 3 * _BUDGET)  # past twice the budget
        assert c.size() > 2 * _BUDGET  # decode tokens accumulate without every
        assert len(seen) == 1, [str(w.message) for w in seen]
        assert "every" in str(seen[0].message) and f"budget={_BUDGET}" in str(seen[0].message)
        # once per process: a second unbounded cache of the same class stays silent
        with warnings.catch_warnings(record=True) as again, routed():
            warnings.simplefilter("always")
            k, v = kv_data(t=40 + 3 * _BUDGET)
            feed(self.cache(budget=_BUDGET), k, v, (40, *([1] * 3 * _BUDGET)))
        assert not [w for w in again if issubclass(w.category, UserWarning)]

    @pytest.mark.parametrize("steps", [0, _BUDGET, 2 * _BUDGET - 41])
    def test_no_warning_below_twice_the_budget_or_with_every(self, steps):
        assert _decode_warnings(self.cache(budget=_BUDGET), steps) == []
        bounded = self.cache(budget=_BUDGET, every=16)
        assert _decode_warnings(bounded, 3 * _BUDGET) == []


def attention_data(
    t: int, h: int = 2, r: int = 2, seed: int = 0, d: int = D, sharp: float = 1.0
) -> tuple[mx.array, mx.array, mx.array]:
    """Random float32 keys, values ``(1, h, t, d)`` and queries ``(1, h * r, t, d)`` with a
    shared direction, so that attention is far from uniform (some tokens collect much more
    attention than others; flatter for ``sharp`` below 1: the queries scaled down)."""
    rng = np.random.default_rng(seed)
    u = rng.normal(size=d)
    k = rng.normal(size=(1, h, t, d)) + 0.5 * rng.normal(size=(1, h, t, 1)) * u
    q = (rng.normal(size=(1, h * r, t, d)) + 2.0 * u) * sharp
    v = rng.normal(size=(1, h, t, d))
    return tuple(mx.array(a.astype(np.float32)) for a in (k, v, q))


def feed_attending(
    cache, k, v, q, chunk: int, stop: int | None = None, scale: float | None = None
) -> list[int]:
    """Prefill in chunks as a routed model does: store each chunk of ``chunk`` tokens, then
    attend with its queries (causal; ``scale`` defaults to ``D ** -0.5``); the first ``stop``
    tokens only, if given. Returns the cache's size after each chunk.

    Shapes:
        k, v ``(B, H, T, D)``, q ``(B, Hq, T, D)``.
    """
    if stop is not None:
        k, v, q = k[:, :, :stop], v[:, :, :stop], q[:, :, :stop]
    scale = k.shape[-1] ** -0.5 if scale is None else scale
    sizes = []
    for s in range(0, k.shape[2], chunk):
        cache.update_and_fetch(k[:, :, s : s + chunk], v[:, :, s : s + chunk])
        cache.attend(q[:, :, s : s + chunk], scale, mask="causal")
        sizes.append(cache.size())
    return sizes


def decode_attending(
    cache, k, v, q, start: int, stop: int, scale: float | None = None
) -> list[int]:
    """Decode as a routed model does, one token at a time: store token ``i`` of ``k, v``,
    then attend its query (``scale`` defaults to ``D ** -0.5``), for ``i`` from ``start`` up
    to ``stop``. Returns the cache's size after each step.

    Shapes:
        k, v ``(B, H, T, D)``, q ``(B, Hq, T, D)``.
    """
    scale = k.shape[-1] ** -0.5 if scale is None else scale
    sizes = []
    for i in range(start, stop):
        cache.update_and_fetch(k[:, :, i : i + 1], v[:, :, i : i + 1])
        cache.attend(q[:, :, i : i + 1], scale)
        sizes.append(cache.size())
    return sizes


def prefill_checked(model, caches: list, prompt: mx.array, chunk: int):
    """Run ``model`` over ``prompt`` ``(1, T)`` with ``caches`` in chunks of ``chunk`` tokens
    (routed, if the caller's ``velox_core.routed`` says so), yielding each chunk's start once
    its caches' states are evaluated. The first chunk's logits are those of mlx-lm's own
    cache (nothing is evicted before a second chunk), to 1e-3."""
    ref = [KVCache() for _ in model.layers]
    for s in range(0, prompt.shape[1], chunk):
        out = model(prompt[:, s : s + chunk], cache=caches)
        if s == 0:
            assert rel_error(out, model(prompt[:, :chunk], cache=ref)) < 1e-3
        mx.eval([c.state for c in caches])
        yield s


def kept_positions(cache, head: int = 0, below: int | None = None) -> set[int]:
    """Absolute positions of the body tokens (those the policy chose) of KV head ``head``,
    row 0 (below ``below`` if given)."""
    pos = np.array(cache.policy_view.body_positions()[head][0]).tolist()
    return {p for p in pos if below is None or p < below}


def stored_positions(cache, head: int = 0) -> set[int]:
    """Absolute positions of every token the cache stores for KV head ``head``, row 0: its
    sinks, its body and its window."""
    sinks, window = cache.policy_view.protected()
    body = cache.policy_view.body_positions()[head]
    out = set(sinks.positions.tolist()) | set(window.positions.tolist())
    return out | (set() if body is None else set(np.array(body[0]).tolist()))


def assert_cut_needs_routing(make: Callable[[], Any], t: int = 300, d: int = D):
    """A cache whose policy votes with queries refuses a cut no query has reached unless
    attention is routed: ``t - 1`` tokens in one chunk, then one more (the cut runs before
    it) raises a ``ValueError`` naming ``routed``; the same inside ``velox_core.routed()``
    cuts, on a second cache from ``make``.

    Returns:
        ``(cache, k, v)``: the routed cache after both updates and the tokens it was fed
        (``kv_data(t=t, d=d)``), for the method's check of what the cut kept.
    """
    k, v = kv_data(t=t, d=d)
    c = make()
    c.update_and_fetch(k[:, :, : t - 1], v[:, :, : t - 1])
    with pytest.raises(ValueError, match="routed"):
        c.update_and_fetch(k[:, :, t - 1 :], v[:, :, t - 1 :])
    c = make()
    with routed():
        c.update_and_fetch(k[:, :, : t - 1], v[:, :, : t - 1])
        c.update_and_fetch(k[:, :, t - 1 :], v[:, :, t - 1 :])
    return c, k, v


def observed_layer_zero(model, caches: list, prompt: mx.array, steps, chunk: int, size: int):
    """Run ``model`` routed over ``caches``: ``prompt`` ``(1, T)`` in chunks of ``chunk``
    tokens, then one decode step per token of ``steps``, asserting after each step that every
    cache holds ``size`` tokens; record the queries layer 0's policy observes (with or without
    the attention weights).

    At layer 0 the keys and queries do not depend on the cache, so a transcription of the
    method fed these can be compared with what layer 0 of ``caches`` keeps.

    Returns:
        ``(k0, v0, q0)``: layer 0's keys and values of every token (from an fp16 cache of
        the same model; float32 numpy ``(1, H, T + len(steps), D)``) and the queries its
        policy observed, in order (``(1, Hq, T + len(steps), D)``).
    """
    seen, inside = [], []
    policy = caches[0].policy
    observe, observe_weights = policy.observe, policy.observe_weights

    def record(view, queries, scale):
        if not inside:  # not called back by observe_weights
            seen.append(np.array(queries[0].astype(mx.float32)))
        observe(view, queries, scale)

    def record_weights(view, queries, scale, weights):
        seen.append(np.array(queries[0].astype(mx.float32)))
        inside.append(True)
        try:
            observe_weights(view, queries, scale, weights)
        finally:
            inside.pop()

    policy.observe, policy.observe_weights = record, record_weights
    with routed(model):
        for s in range(0, prompt.shape[1], chunk):
            model(prompt[:, s : s + chunk], cache=caches)
        for t in steps:
            model(mx.array([[t]]), cache=caches)
            assert all(c.size() == size for c in caches)
    k0, v0 = layer_zero_kv(model, mx.concatenate([prompt, mx.array([list(steps)])], axis=1))
    return k0[None], v0[None], np.concatenate(seen, axis=1)[None]


def two_chunk_prompt(cache, budget: int, chunk: int = 128):
    """A tiny llama with ``cache`` in every layer (``make_cache``) takes a random prompt of
    ``2 * chunk`` tokens in two chunks, routed: every layer holds the first chunk whole, and
    ``budget + chunk`` tokens after the second (the cut the first chunk owed runs before it
    is stored).

    Returns:
        ``(model, caches, k0, scale)``: layer 0's keys of the prompt (:func:`layer_zero_kv`,
        float32 numpy ``(H, 2 * chunk, D)``) and its attention's scale, for a transcription
        of the method's cut at layer 0.
    """
    model = tiny_model("llama")
    prompt = mx.random.randint(0, 512, (1, 2 * chunk), key=mx.random.key(0))
    caches = make_cache(model, cache)
    k0, _ = layer_zero_kv(model, prompt)
    with routed(model):
        model(prompt[:, :chunk], cache=caches)
        assert all(c.size() == chunk for c in caches)
        model(prompt[:, chunk:], cache=caches)
    assert all(c.size() == budget + chunk for c in caches)
    return model, caches, k0, model.layers[0].self_attn.scale


def decode_bounded(model, caches: list, tokens, size: int):
    """Decode ``tokens`` (ints) through ``model`` with ``caches``, a step each (routed, if
    the caller's ``velox_core.routed`` says so), checking after each step that every cache
    holds ``size`` tokens; yields each step's index once checked."""
    for i, t in enumerate(tokens):
        model(mx.array([[t]]), cache=caches)
        assert all(c.size() == size for c in caches), i
        yield i


def layer_zero_kv(model, tokens: mx.array) -> tuple[np.ndarray, np.ndarray]:
    """Layer 0's keys and values of ``tokens`` ``(1, T)`` through ``model`` with mlx-lm's own
    cache (at layer 0 they do not depend on the cache): float32 numpy ``(H, T, D)`` each."""
    full = [KVCache() for _ in model.layers]
    model(tokens, cache=full)
    t = tokens.shape[1]
    k0, v0 = (np.array(a[0, :, :t].astype(mx.float32)) for a in full[0].state[:2])
    return k0, v0


def assert_attends_to(cache, q, k, v, positions: Callable[[int], set[int]], scale: float):
    """``cache.attend(q)`` equals fp16 attention over exactly the tokens ``positions(h)`` of
    ``k, v`` for each KV head ``h`` (its query heads ``h * r ... (h + 1) * r - 1``), to 1e-4.

    Shapes:
        q ``(B, Hq, L, D)``, k, v ``(B, H, T, D)`` every token the cache was fed.
    """
    out = cache.attend(q, scale)
    n = k.shape[1]
    r = q.shape[1] // n
    for h in range(n):
        pos = mx.array(sorted(positions(h)))
        ref = mx.fast.scaled_dot_product_attention(
            q[:, h * r : (h + 1) * r], k[:, h : h + 1, pos], v[:, h : h + 1, pos], scale=scale
        )
        assert rel_error(out[:, h * r : (h + 1) * r], ref) < 1e-4, h


def assert_resumes_alike(cache, loaded, k, v, q=None, scale: float | None = None) -> None:
    """``cache`` and ``loaded`` (its copy through a file, :func:`reloaded`) store the rest of
    ``k, v`` (from their offset on, in one update: a pending cut runs) and then hold the same
    tokens in every KV head (:func:`stored_positions`); given ``q``, the queries of those
    tokens attend alike in both (``scale`` defaults to ``D ** -0.5``).

    Shapes:
        k, v ``(1, H, T, D)``, q ``(1, Hq, T, D)``: every token, from the first.
    """
    start = cache.offset
    assert loaded.offset == start
    for x in (cache, loaded):
        x.update_and_fetch(k[:, :, start:], v[:, :, start:])
    held = [[stored_positions(x, h) for h in range(k.shape[1])] for x in (loaded, cache)]
    assert held[0] == held[1]
    if q is not None:
        scale = k.shape[-1] ** -0.5 if scale is None else scale
        got = loaded.attend(q[:, :, start:], scale)
        assert mx.array_equal(got, cache.attend(q[:, :, start:], scale))


def assert_vote_settings_refused(policy: Callable[..., Any]) -> None:
    """A policy voting with an observation window (the settings ``observe``, ``kernel`` and
    ``pooling`` of ``velox_core.policy.voting``) refuses, each with a ``ValueError`` naming
    the setting: a budget with no room beyond 4 sinks and a 32-token window (once in a
    cache), an even pooling kernel, and an unknown pooling."""
    with pytest.raises(ValueError, match="observe"):
        VeloxCache(sinks=4, policy=policy(budget=36, observe=32))
    with pytest.raises(ValueError, match="kernel"):
        policy(budget=64, kernel=2)
    with pytest.raises(ValueError, match="pooling"):
        policy(budget=64, pooling="sum")


def reloaded(cache, path):
    """``cache`` saved to the file ``path`` and loaded back; the loaded cache's policy is of
    the same class with the same settings. Returns the loaded cache."""
    save_cache(path, [cache])
    (loaded,) = load_cache(path)
    assert type(loaded.policy) is type(cache.policy)
    assert loaded.policy.config() == cache.policy.config()
    return loaded


def batch_rows_apart(make, rows, chunk: int, positions=kept_positions):
    """Two rows chose their tokens apart: a batch of ``rows`` (two ``(k, v, q)``, each
    ``(1, H, T + 1, D)``) prefilled together (``T`` tokens, attending in chunks of ``chunk``),
    its row 1 extracted, and row 1 prefilled alone in a cache of its own; each then stores
    token ``T`` (the cut runs). Row 1 of the batch, the extracted row and the row alone keep
    the same tokens (``positions`` of the cache, head 0), and row 0 keeps others.

    Returns:
        ``(batch, extracted, alone)``.
    """
    k, v, q = (mx.concatenate(p, axis=0) for p in zip(*rows))
    t = k.shape[2] - 1
    batch = make()
    feed_attending(batch, k, v, q, chunk, stop=t)
    one = batch.extract(1)
    alone = make()
    k1, v1, q1 = rows[1]
    feed_attending(alone, k1, v1, q1, chunk, stop=t)
    batch.update_and_fetch(k[:, :, t:], v[:, :, t:])
    for x in (one, alone):
        x.update_and_fetch(k1[:, :, t:], v1[:, :, t:])
    pos = np.array(mx.stack(batch.policy_view.body_positions(), axis=1))
    assert set(pos[1, 0].tolist()) == positions(one) == positions(alone)
    assert positions(alone) != set(pos[0, 0].tolist())
    return batch, one, alone


def recommended_presets(method, voted: bool = False) -> tuple[VeloxCache, VeloxCache]:
    """An eviction method's recommended settings are one of the pairs the eviction packages
    share (velox_core.cache.eviction's): a budget of 1,024 tokens in fp16 and with 4-bit codes
    in groups of 32, or with ``voted`` (the observation-window votes: SnapKV and the methods
    built on them) a 15-token pooling kernel, in fp16 and with 8-bit codes. Checked, and both
    made by name, the second's keys and values coded at the pair's bits. Returns the caches
    ``(fp16, coded)``, for the method's own checks."""
    assert method.recommended == (RECOMMENDED_VOTED if voted else RECOMMENDED)
    fp16, coded = (make(method.name, **s) for s in method.recommended)
    bits = 8 if voted else 4
    assert coded.tiers[0].key_codec.bits == coded.tiers[0].value_codec.bits == bits
    return fp16, coded


def composed_cache(policy, k, v, q) -> VeloxCache:
    """``policy`` composed by hand in a cache of 8-bit codes with 4 sinks and a window of 8:
    the first 300 tokens of ``k, v, q`` attended in chunks of 128, then token 300 stored (the
    cut runs). The sinks and the window hold their tokens exactly as given (checked); returns
    the cache, for the method's check of its body.

    Shapes:
        k, v ``(1, H, 301, D)``, q ``(1, Hq, 301, D)``.
    """
    c = VeloxCache(Uniform(8), Uniform(8), sinks=4, window=8, policy=policy)
    feed_attending(c, k, v, q, chunk=128, stop=300)
    c.update_and_fetch(k[:, :, 300:], v[:, :, 300:])
    kk, _ = c.keys_and_values()
    assert mx.array_equal(kk[:, :, :4], k[:, :, :4])
    assert mx.array_equal(kk[:, :, -8:], k[:, :, 293:301])
    return c


def assert_state_format(cache, state: dict, meta: dict, k, v):
    """``cache``'s policy holds its state in the saved format ``state`` (arrays by name) and
    ``meta``: its arrays have those names and its meta is ``meta``; a copy of the cache given
    ``state`` and ``meta`` by hand then stores ``k, v`` (the cut runs) beside the cache.

    Returns:
        The copy, for the method's check that it kept what the cache kept.
    """
    assert set(cache.policy.state()) == set(state)
    assert cache.policy.meta() == meta
    d = cache.copy()
    d.policy.set_state(state, meta)
    feed([cache, d], k, v, k.shape[2])
    return d
