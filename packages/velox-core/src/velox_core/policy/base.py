"""Retention policies: which tokens a cache keeps. A policy never sees how tokens are stored.

A :class:`RetentionPolicy` is attached to one :class:`~velox_core.cache.VeloxCache` and never
holds it: every hook is given the cache's :class:`~velox_core.policy.view.PolicyView`
(``view``), which holds the token counts, the decoded body keys and values with their
absolute positions, one array per KV head (``view.body_keys()``, ``view.body_positions()``),
the sinks and window as stored, the layout, and the ``evict`` action; :meth:`observe` also
sees the queries of every attention call (for policies that score tokens by attention), and
:meth:`observe_weights` the call's softmax weights where the policy asks for them. A
policy answers with the tokens to keep; the cache gathers them, so evicted tokens leave
memory.

When eviction runs (:meth:`before_update`, called before new tokens are stored):

* after a multi-token chunk (chunked prefill): the next update first cuts the cache back to
  ``budget``, so peak memory stays at ``budget`` plus one chunk, not the prompt;
  With ``prefill="prompt"`` (:data:`PREFILLS`) a multi-token update cuts nothing: the
  prompt's chunks accumulate and the cut they owe is made at the first single-token update,
  voted by the prompt's last queries, as the papers and kvpress compress a prompt once after
  its prefill (a question at the prompt's end chooses what is kept); peak memory then holds
  the whole prompt;
* during decode, when ``every`` is set and the cache exceeds ``budget`` by ``every`` tokens:
  long generations stay bounded (at most ``budget + every`` tokens). Without ``every`` decode
  tokens accumulate (the prompt-only compression of SnapKV's paper): once the cache holds
  twice its budget a ``UserWarning`` says so, once per policy class and process.

``budget`` counts every token kept per KV head: sinks, body and window. A subclass defines
:meth:`score` (higher keeps) or, for per-head budgets, overrides :meth:`select`.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any, ClassVar

import mlx.core as mx

from ..configured import Configured
from ..validation import check_int

__all__ = ["warn_unbounded"]

# when a prompt prefilled in chunks is cut: after each chunk (peak memory: budget plus one
# chunk) or once, at its end (the whole prompt held until the first decoded token)
PREFILLS = ("chunks", "prompt")


def top_k_sorted(scores: mx.array, k: int) -> mx.array:
    """Indices of the ``k`` largest scores along the last axis, ascending (temporal order).

    Shapes:
        scores ``(..., T)``; returns int32 ``(..., min(k, T))``.
    """
    t = scores.shape[-1]
    if k >= t:
        return mx.broadcast_to(mx.arange(t, dtype=mx.int32), scores.shape)
    if k <= 0:
        return mx.zeros((*scores.shape[:-1], 0), dtype=mx.int32)
    idx = mx.argpartition(-scores.astype(mx.float32), kth=k - 1, axis=-1)[..., :k]
    return mx.sort(idx, axis=-1).astype(mx.int32)


def require_routed(view: Any, method: str, why: str) -> None:
    """``ValueError`` unless ``view``'s cache is routed; ``why``: what its queries decide."""
    if not view.routed:
        raise ValueError(
            f"{method}: {why}, and only velox attention sees the queries: run the model "
            "inside velox_core.routed(model) (velox_core.generate does)"
        )


class RetentionPolicy(Configured):
    """Base class, and the simplest policy: keep the most recent tokens (``budget=None``
    keeps every token).

    Args:
        budget: tokens kept per KV head (sinks + body + window), or None.
        every: during decode, evict once the cache holds ``budget + every`` tokens
            (None: evict only after prefill chunks).
    """

    name: ClassVar[str] = "recent"
    # the constructor arguments :meth:`config` saves beside budget and every, each held by
    # the attribute of the same name (a tuple is saved as a list, as JSON holds it)
    settings: ClassVar[tuple[str, ...]] = ()

    def __init__(self, budget: int | None = None, every: int | None = None):
        self.budget = None if budget is None else check_int("budget", budget, minimum=1)
        self.every = None if every is None else check_int("every", every, minimum=1)
        self.prefill = "chunks"  # PREFILLS; set by the cache's config (EvictionConfig.prefill)
        self._chunk_pending = False

    def config(self) -> dict[str, Any]:
        own = ((name, getattr(self, name)) for name in self.settings)
        return {
            "budget": self.budget,
            "every": self.every,
            **{name: list(v) if isinstance(v, tuple) else v for name, v in own},
        }

    # -- hooks the cache calls ------------------------------------------------------------
    def attach(self, view) -> None:
        """Called once by the cache that owns this policy, with its view (no token stored
        yet: only ``sinks`` and ``window`` are known)."""
        if self.budget is not None and self.budget <= view.sinks + view.window:
            raise ValueError(
                f"budget={self.budget} must exceed sinks + window = {view.sinks + view.window} "
                "(those tokens are always kept)"
            )

    def bind(self, model: Any = None, layer: int | None = None) -> None:
        """Called by ``make_cache`` with the model and the layer index."""

    def observe(self, view, queries: mx.array, scale: float) -> None:
        """Called with the (post-RoPE) queries of every attention call, before attention."""

    def wants_weights(self, n: int) -> bool:
        """Whether this policy scores tokens by the softmax weights of an attention call of
        ``n`` queries (asked before the call): then, where the cache's reference path attends
        (a few queries, one body record, no sink logits), it hands them to
        :meth:`observe_weights` after attention instead of calling :meth:`observe`, so that
        they are not computed again beside the call. The base policy: never."""
        return False

    def observe_weights(self, view, queries: mx.array, scale: float, weights: mx.array) -> None:
        """Called after attention, instead of :meth:`observe`, where :meth:`wants_weights`
        said so, with the call's softmax weights over every stored token (masked tokens 0).
        The base policy passes the queries to :meth:`observe`.

        Shapes:
            queries ``(B, Hq, n, D)``; weights float32 ``(B, H, R, n, S)``: the query heads
            of KV head ``h`` are ``h * R ... h * R + R - 1`` (mlx-lm's grouped layout),
            ``S`` every stored token in storage order (sinks, body, window).
        """
        self.observe(view, queries, scale)

    def after_update(self, view, start: int) -> None:
        """Called after tokens ``[start, view.offset)`` were stored."""

    def decode_segments(self, view, queries: mx.array, scale: float) -> list | None:
        """The stored tokens one decode step attends (sparse attention), or None: all of them.

        Called by ``VeloxCache.attend`` for a single query per sequence (no mask array), after
        :meth:`observe`; the segments (:class:`velox_core.cache.attention.Segment`, in
        temporal order) are attended with one joint softmax instead of every stored token.
        The base policy attends every token; velox-rocketkv's picks its top-k tokens.

        Shapes:
            queries ``(B, Hq, 1, D)``, post-RoPE.
        """
        return None

    def before_update(self, view, incoming: int) -> None:
        """Evict down to the budget when due (see the module docstring)."""
        after_chunk, self._chunk_pending = self._chunk_pending, incoming > 1
        if self.budget is None:
            return
        over = view.size() - self.budget
        if self.every is None and over >= self.budget and not after_chunk:
            warn_unbounded(self, view.size())
        if over <= 0 or not (after_chunk or (self.every is not None and over >= self.every)):
            return
        keep = self.select(view, max(self.budget - view.protected_count(), 0))
        view.evict(keep)

    def defer(self) -> None:
        """A multi-token update under ``prefill="prompt"`` (the cache calls it instead of
        :meth:`before_update`): nothing is cut now, and the tokens stored so far owe the cut a
        chunk owes, made at the next update that is not deferred."""
        self._chunk_pending = True

    def hold_stored(self) -> None:
        """No cut is due for the tokens stored so far: the cut a chunk would get when the next
        tokens arrive is dropped (a later chunk, or ``every`` during decode, cuts as usual).
        For a prompt compressed once and then continued uncompressed (kvpress's protocol: the
        context cut, the question kept whole)."""
        self._chunk_pending = False

    # -- choosing ------------------------------------------------------------------------------
    def score(self, view) -> list[mx.array]:
        """Per KV head, a ``(B, T_h)`` score of each body token (higher is kept first).

        The base policy keeps the most recent tokens.
        """
        return [None if p is None else p.astype(mx.float32) for p in view.body_positions()]

    def select(self, view, k: int):
        """Indices of the body tokens to keep: ``(B, H, k)``, the top ``k`` per head."""
        if type(self).score is RetentionPolicy.score:  # the recency score, every head at once
            pos = view.body_positions(joined=True)
            if pos is None:
                return mx.zeros((view.batch, view.kv_heads, 0), dtype=mx.int32)
            return top_k_sorted(pos.astype(mx.float32), k)
        scores = self.score(view)
        if any(s is None for s in scores):
            return mx.zeros((view.batch, len(scores), 0), dtype=mx.int32)
        return top_k_sorted(mx.stack(scores, axis=1), k)

    # -- batches -----------------------------------------------------------------------------
    def batch_key(self) -> Any:
        """What the rows of two caches must also agree on to be batched in one cache
        (``VeloxBatch.merge`` joins caches of equal settings and layout only where their
        policies' keys are equal): a decision the policy made for its own sequences, such as
        a layer budget chosen from their prompt. None (the default): nothing."""
        return None

    def filter_batch(self, index: mx.array) -> None:
        """Keep only these batch rows of any per-row state (``VeloxCache.filter``)."""

    def extend_batch(self, other: RetentionPolicy) -> None:
        """Append the batch rows of ``other``'s per-row state (``VeloxCache.extend``)."""

    # -- state -------------------------------------------------------------------------------
    def state(self) -> dict[str, mx.array]:
        return {}

    def meta(self) -> Any:
        """JSON-serializable scalars of the state."""
        return {"chunk_pending": self._chunk_pending}

    def set_state(self, state: dict[str, mx.array], meta: Any) -> None:
        if state:
            raise ValueError(f"{self.name}: this policy has no array state, got {sorted(state)}")
        self._chunk_pending = bool((meta or {}).get("chunk_pending", False))

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.state().values())


_WARNED: set[str] = set()


def warn_unbounded(policy: RetentionPolicy, size: int) -> None:
    """Once per policy class and process: ``budget`` bounds the prompt, not the decode."""
    name = getattr(policy, "name", type(policy).__name__)
    if name in _WARNED:
        return
    _WARNED.add(name)
    warnings.warn(
        f"{name}: budget={policy.budget} bounds the prompt only, and decode tokens accumulate "
        f"past it (now {size} tokens per KV head); pass every=N to cut the cache again once "
        f"it holds budget + N tokens",
        UserWarning,
        stacklevel=4,
    )


def warn_layer_unbounded(
    name: str, warned: list[bool], size: int, target: int, where: str = ""
) -> None:
    """Once per process (``warned``: the package's one-element flag, set here), from
    :func:`layer_cut_target`'s ``unbounded``: without ``every``, a policy whose layers keep
    their own share of the budget (``name``: velox-pyramidkv, velox-squeeze) bounds the
    prompt only. It warns once a KV head holds ``size`` tokens, twice the layer's ``target``
    or more; ``where`` follows the target in the message (the layer's place)."""
    if warned[0] or size < 2 * target:
        return
    warned[0] = True
    warnings.warn(
        f"{name}: the layer budget ({target} tokens{where}) bounds the prompt only, and decode "
        f"tokens accumulate past it (now {size} per KV head); pass every=N to cut again once "
        "a layer exceeds its budget by N",
        UserWarning,
        stacklevel=6,  # called from before_update through unbounded and layer_cut_target
    )


def layer_cut_target(
    policy: RetentionPolicy,
    view,
    incoming: int,
    target: Callable[[int], int],
    unbounded: Callable[[int], None],
) -> int | None:
    """``before_update``'s cadence for a policy whose layer keeps its own share of the budget
    (velox-pyramidkv, velox-squeeze): ``target(seen)``, the tokens the layer keeps per KV
    head once ``seen`` tokens have arrived, when a cut to it is due (after a prefill chunk,
    or during decode once the layer holds ``every`` tokens more), else None. Without
    ``every`` decode never cuts: ``unbounded(size)`` is called instead with the tokens a KV
    head holds (the policy warns once they pass its budget)."""
    after_chunk, policy._chunk_pending = policy._chunk_pending, incoming > 1
    if policy.budget is None:
        return None
    size = view.size()
    if not (after_chunk or policy.every is not None):
        unbounded(size)
        return None
    kept = target(view.offset)
    over = size - kept
    if over <= 0 or not (after_chunk or over >= policy.every):
        return None
    return kept
