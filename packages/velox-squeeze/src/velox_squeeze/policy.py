"""``SqueezePolicy``: a base retention policy under SqueezeAttention's layer budgets.

SqueezeAttention (Wang, Cui and Gan, arXiv 2404.04793) observes that the attention layers
of a model matter unequally, and that how much one matters shows in how little it changes
the hidden states: the cosine between the residual stream entering the attention block and
the one leaving it is near 1 where the attention adds little. It measures that cosine on the
prompt, clusters the layers into three groups by it, and gives the group of highest cosine a
``p`` share of the average budget, the other layers the rest
(:mod:`velox_squeeze.allocate`); inside each layer a sequence-wise policy (the paper's
StreamingLLM, H2O or sliding window) chooses the tokens.

How it runs in velox:

* **The cosine** comes from the model itself: ``bind(model, i)`` (``make_cache``) installs
  :mod:`velox_squeeze.observe` on the model once, which hands each prefill chunk's per-token
  cosines of a layer to that layer's policy (:meth:`SqueezePolicy.add_importance`): a
  running sum and count per batch row (state ``importance``, ``(2, B)`` float32).
* **The allocation**: after the last layer of each multi-token forward the observer takes
  each sequence's mean cosine of every layer holding a squeeze cache, clusters them and gives
  each layer's policy its :class:`~velox_squeeze.allocate.Place` (saved with the cache).
  With chunked prefill it is decided again after each chunk from the prompt so far;
  ``prefill="prompt"`` decides it once from the whole prompt, as the paper. Rows of one
  cache (sequences batched at equal lengths) share one allocation, decided from their mean;
  mlx-lm's ragged batches keep each sequence in a cache of its own (``VeloxBatch``), so each
  is decided alone, as its single run.
* **The cut** (:meth:`SqueezePolicy.before_update`): after each prefill chunk, and with
  ``every`` during decode, the layer is cut to its budget
  (:func:`~velox_squeeze.allocate.layer_budget` of ``view.offset``) by the base policy's
  choice: SnapKV's observation-window votes (velox-core's
  :class:`~velox_core.policy.WindowVotePolicy`, which sees queries only through routed
  attention) or StreamingLLM's most recent tokens (velox-core's
  :class:`~velox_core.RetentionPolicy`, the cache's ``sinks`` kept).

A cache fed without the observer (made by hand, or a model ``make_cache`` never bound it to)
measures nothing and keeps the uniform ``budget``.
"""

from __future__ import annotations

import warnings
from typing import Any

import mlx.core as mx

from velox_core import RetentionPolicy
from velox_core.policy import WindowVotePolicy
from velox_core.policy.base import layer_cut_target, warn_layer_unbounded

from .allocate import Place, layer_budget
from .config import check_base, check_p

__all__ = ["SqueezePolicy"]

_WARNED = [False]
_WARNED_UNMEASURED = [False]


class SqueezePolicy(RetentionPolicy):
    """SqueezeAttention's retention policy for one layer.

    Args:
        budget: tokens kept per KV head, averaged over the layers, or None (keep all).
        every: during decode, cut again once the layer holds its budget + ``every`` tokens
            (None: only after prefill chunks).
        p: the squeeze factor (``[0, 1]``).
        base: ``"snapkv"`` or ``"streamingllm"``: what chooses the tokens in the layer.
        observe, kernel, pooling: SnapKV's vote (None: its defaults); ``base="snapkv"`` only.
    """

    name = "squeeze"
    settings = ("p", "base")

    def __init__(
        self,
        budget: int | None = None,
        every: int | None = 32,
        p: float = 0.4,
        base: str = "snapkv",
        observe: int | None = None,
        kernel: int | None = None,
        pooling: str | None = None,
    ):
        super().__init__(budget, every)
        self.p = check_p(p)
        vote = check_base(base, observe, kernel, pooling)
        self.base = base
        # SnapKV's vote as given (None: its default; ``observe`` names the hook below)
        self.vote_given = {"observe": observe, "kernel": kernel, "pooling": pooling}
        if base == "snapkv":
            self.inner: RetentionPolicy = WindowVotePolicy(budget, every, **vote)
        else:
            self.inner = RetentionPolicy(budget, every)
        self.always = vote.get("observe", 0)  # sinks + max(window, observe), set at attach
        self.place: Place | None = None  # decided by the observer (velox_squeeze.observe)
        self._sum: mx.array | None = None  # (B,) float32: summed cosines of observed tokens
        self._count: mx.array | None = None  # (B,) float32: tokens observed

    def config(self) -> dict[str, Any]:
        return {**super().config(), **self.vote_given}

    def attach(self, view) -> None:
        observe = self.inner.vote.observe if self.base == "snapkv" else 0
        self.always = view.sinks + max(view.window, observe)
        if self.budget is not None and self.budget <= self.always:
            raise ValueError(
                f"budget={self.budget} must exceed sinks + max(window, observe) = "
                f"{self.always} (every layer keeps those tokens; the allocation shares out "
                "the rest)"
            )
        self.inner.attach(view)

    def bind(self, model: Any = None, layer: int | None = None) -> None:
        """Install the importance observer on ``model`` (once per model; see
        :mod:`velox_squeeze.observe`); a ``ValueError`` names a model it cannot observe."""
        if model is not None:
            from .observe import install

            install(model)

    # -- importance ---------------------------------------------------------------------------
    def add_importance(self, cos: mx.array) -> None:
        """Add the per-token cosines of one prefill chunk, ``(B, N)`` (the rows' real tokens)."""
        b, n = cos.shape
        s = mx.sum(cos.astype(mx.float32), axis=1)
        c = mx.full((b,), float(n), dtype=mx.float32)
        if self._sum is not None and self._sum.shape[0] != b:
            raise ValueError(f"squeeze: cosines of {b} rows for a cache of {self._sum.shape[0]}")
        if self._sum is not None:
            s, c = self._sum + s, self._count + c
        self._sum, self._count = s, c
        mx.eval(self._sum, self._count)

    def row_importance(self) -> list[float | None] | None:
        """Each row's mean cosine so far (None for a row with no observed token; None before
        any)."""
        if self._sum is None:
            return None
        sums, counts = self._sum.tolist(), self._count.tolist()
        return [s / c if c > 0 else None for s, c in zip(sums, counts)]

    def layer_budget(self, seen: int) -> int:
        """Tokens this layer keeps per KV head once ``seen`` tokens have arrived."""
        return layer_budget(self.budget, self.always, self.p, seen, self.place)

    # -- when to cut --------------------------------------------------------------------------
    def before_update(self, view, incoming: int) -> None:
        """Cut to the layer's budget after a prefill chunk, or with ``every`` during decode."""

        def unbounded(size: int) -> None:
            if not _WARNED[0] and size >= 2 * self.budget:
                kept = self.layer_budget(view.offset)
                warn_layer_unbounded("squeeze", _WARNED, size, kept)

        target = layer_cut_target(self, view, incoming, self.layer_budget, unbounded)
        if target is None:
            return
        if self._sum is None and not _WARNED_UNMEASURED[0]:
            _warn_unmeasured(target)
        view.evict(self.inner.select(view, max(target - view.protected_count(), 0)))

    # -- the base policy chooses --------------------------------------------------------------
    def observe(self, view, queries: mx.array, scale: float) -> None:
        self.inner.observe(view, queries, scale)

    def after_update(self, view, start: int) -> None:
        self.inner.after_update(view, start)

    def score(self, view) -> list:
        return self.inner.score(view)

    def select(self, view, k: int):
        return self.inner.select(view, k)

    # -- batch rows ---------------------------------------------------------------------------
    def batch_key(self) -> Any:
        """Rows batched in one cache share one allocation: caches placed otherwise stay apart."""
        return None if self.place is None else self.place.key()

    def filter_batch(self, idx: mx.array) -> None:
        self.inner.filter_batch(idx)
        if self._sum is not None:
            self._sum, self._count = self._sum[idx], self._count[idx]

    def extend_batch(self, other: SqueezePolicy) -> None:
        if self.place != other.place:
            raise ValueError(
                "squeeze: extend needs caches with the same layer allocation (each sequence's "
                f"is decided from its prompt): {self.place} vs {other.place}"
            )
        self.inner.extend_batch(other.inner)
        if (self._sum is None) != (other._sum is None):
            raise ValueError(
                "squeeze: extend needs caches that both measured their prompt, or neither"
            )
        if self._sum is not None:
            self._sum = mx.concatenate([self._sum, other._sum])
            self._count = mx.concatenate([self._count, other._count])

    # -- state: the base policy's arrays and {"importance": (2, B) float32} --------------------
    def state(self) -> dict[str, mx.array]:
        out = dict(self.inner.state())
        if self._sum is not None:
            out["importance"] = mx.stack([self._sum, self._count])
        return out

    def meta(self) -> Any:
        place = None if self.place is None else self.place.key()
        return {**super().meta(), "inner": self.inner.meta(), "place": place}

    def set_state(self, state: dict[str, mx.array], meta: Any) -> None:
        state = dict(state)
        imp = state.pop("importance", None)
        if imp is not None and (imp.ndim != 2 or imp.shape[0] != 2 or imp.dtype != mx.float32):
            raise ValueError(
                f"squeeze: the importance state must be float32 (2, B), got {imp.dtype} "
                f"{tuple(imp.shape)}"
            )
        meta = meta or {}
        super().set_state({}, meta)
        self.inner.set_state(state, meta.get("inner"))
        self._sum, self._count = (None, None) if imp is None else (imp[0], imp[1])
        place = meta.get("place")
        self.place = None if place is None else Place.from_key(place)


def _warn_unmeasured(target: int) -> None:
    """Once per process: a cut in a cache that measured no importance (no observer)."""
    _WARNED_UNMEASURED[0] = True
    warnings.warn(
        f"squeeze: this cache measured no layer importance (no observer saw its model's hidden "
        f"states), so it keeps the uniform budget ({target} tokens per KV head); make the "
        "caches with velox_core.make_cache(model, ...), which installs the observer",
        UserWarning,
        stacklevel=4,
    )
