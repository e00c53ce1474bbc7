"""``AdaKVPolicy``: Ada-KV's adaptive head-wise budgets over a base scorer (arXiv 2407.11550).

When an eviction is due, the base scorer scores every body token of every KV head (the
SnapKV observation-window vote by default), :func:`~velox_adakv.allocate.adaptive_keep`
splits the layer budget among the heads, and the cache keeps each head's share in its own
record (per-head storage, no padding), so moving budget between heads costs no memory.

Per-head storage has batch size 1 and is read only by velox attention: with batch size 1
eviction needs routed attention (``velox_core.routed(model)`` or ``velox_core.generate``), and
so does the SnapKV scorer (it sees queries there); otherwise :meth:`before_update` raises
before anything is evicted. With batch size > 1 the policy falls back to the uniform split
(each head its own top ``k``: SnapKV), stored densely.

``budget`` is the average per KV head: the layer keeps ``budget x H_kv`` tokens (Ada-KV's
layer budget); an eviction is due when the layer holds more than that, after a prefill chunk
or, with ``every``, once it is exceeded by ``every`` tokens per head.
"""

from __future__ import annotations

import importlib
from typing import Any, ClassVar

import mlx.core as mx

from velox_core import RetentionPolicy
from velox_core.policy import WindowVote, top_k_sorted
from velox_core.policy.base import warn_unbounded
from velox_core.validation import check_choice, check_float

from .allocate import adaptive_keep
from .config import BASES
from .scorer import ObservationWindow

__all__ = ["AdaKVPolicy"]


def _qfilters_policy(budget: int | None) -> RetentionPolicy:
    """The optional velox_qfilters package's retention policy (imported only when asked)."""
    try:
        mod = importlib.import_module("velox_qfilters")
    except ImportError as e:
        raise ImportError(
            "adakv: base='qfilters' needs the optional package velox-qfilters (import "
            "velox_qfilters), which is not installed; install it or use base='snapkv'"
        ) from e
    found = [
        p
        for p in getattr(getattr(mod, "METHOD", None), "policies", ())
        if isinstance(p, type) and issubclass(p, RetentionPolicy)
    ]
    if not found:
        raise ValueError("adakv: velox_qfilters.METHOD registers no retention policy to score with")
    return found[0](budget=budget)


class AdaKVPolicy(RetentionPolicy):
    """Ada-KV retention. Parameters as in :class:`~velox_adakv.config.AdaKVConfig`.

    Args:
        budget: average tokens kept per KV head (sinks + body + window).
        every: decode steps over budget between evictions (None: after prefill chunks only).
        alpha: safeguard fraction of the uniform share each head keeps at least.
        observe: queries in the observation window (``base="snapkv"``).
        kernel: pooling width over positions (``base="snapkv"``).
        pooling: ``"max"`` or ``"avg"`` (``base="snapkv"``).
        base: ``"snapkv"`` or ``"qfilters"``.
    """

    name: ClassVar[str] = "adakv"
    settings: ClassVar[tuple[str, ...]] = ("alpha", "base")

    def __init__(
        self,
        budget: int | None = None,
        every: int | None = None,
        alpha: float = 0.2,
        observe: int = 32,
        kernel: int = 7,
        pooling: str = "max",
        base: str = "snapkv",
    ):
        super().__init__(budget, every)
        self.alpha = check_float("alpha", alpha, minimum=0.0, maximum=1.0)
        self.vote = WindowVote(observe, kernel, pooling)
        self.base = check_choice("base", base, BASES)
        self._window = ObservationWindow(self.vote)
        self._inner = _qfilters_policy(budget) if base == "qfilters" else None

    def config(self) -> dict[str, Any]:
        return {**super().config(), **self.vote.config()}

    # -- hooks -----------------------------------------------------------------------------
    def attach(self, view) -> None:
        super().attach(view)
        if self._inner is not None:
            self._inner.attach(view)

    def bind(self, model: Any = None, layer: int | None = None) -> None:
        if self._inner is not None:
            self._inner.bind(model, layer)

    def observe(self, view, queries: mx.array, scale: float) -> None:
        if self._inner is not None:
            self._inner.observe(view, queries, scale)
        else:
            self._window.add(queries, view.offset, scale)

    def after_update(self, view, start: int) -> None:
        if self._inner is not None:
            self._inner.after_update(view, start)

    def before_update(self, view, incoming: int) -> None:
        """Evict down to the layer budget when due (after a chunk, or ``every``)."""
        after_chunk = self._chunk_pending
        sizes = view.body_sizes()
        if self.budget is not None and sizes:
            k = max(self.budget - view.protected_count(), 0)
            over = sum(sizes) - len(sizes) * k
            every = self.every is not None and over >= self.every * len(sizes)
            if self.every is None and over >= self.budget * len(sizes) and not after_chunk:
                warn_unbounded(self, view.size())  # twice the budget per head, on average
            if over > 0 and (after_chunk or every):
                self._check_routed(view)
                view.evict(self.select(view, k))
        self._chunk_pending = incoming > 1

    def _check_routed(self, view) -> None:
        why = []
        if _batch(view) == 1 and self.alpha < 1.0:
            why.append("per-head budgets are read only by velox attention")
        if self.base == "snapkv":
            why.append("the SnapKV scorer sees queries only there")
        if why and not view.routed:
            raise ValueError(
                f"adakv: eviction needs routed attention ({'; '.join(why)}): run the model "
                "inside velox_core.routed(model) or use velox_core.generate"
            )

    # -- choosing --------------------------------------------------------------------------
    def score(self, view) -> list[mx.array | None]:
        """Per KV head, the base scorer's ``(B, T_h)`` score of each body token."""
        if self._inner is not None:
            return self._inner.score(view)
        return self._window.scores(view)

    def select(self, view, k: int):
        """Batch 1: one index array per head (adaptive budgets). Batch > 1, or
        ``alpha == 1``: ``(B, H, k)``, the uniform split."""
        scores = self.score(view)
        b = _batch(view)
        if b > 1 or (self.alpha >= 1.0 and not view.ragged):
            return top_k_sorted(mx.stack(scores, axis=1), k)
        flat = [mx.zeros((0,)) if s is None else s[0] for s in scores]
        return adaptive_keep(flat, k, self.alpha)

    # -- state -----------------------------------------------------------------------------
    def state(self) -> dict[str, mx.array]:
        if self._inner is not None:
            return {f"base.{k}": a for k, a in self._inner.state().items()}
        return self._window.state()

    def meta(self) -> Any:
        inner = None if self._inner is None else self._inner.meta()
        return {**super().meta(), "window": self._window.meta(), "base": inner}

    def set_state(self, state: dict[str, mx.array], meta: Any) -> None:
        meta = meta or {}
        self._chunk_pending = bool(meta.get("chunk_pending", False))
        if self._inner is not None:
            if any(not k.startswith("base.") for k in state):
                raise ValueError(f"adakv: unexpected policy arrays {sorted(state)}")
            self._inner.set_state({k[5:]: a for k, a in state.items()}, meta.get("base"))
        else:
            self._window.set_state(state, meta.get("window") or {})

    def filter_batch(self, idx: mx.array) -> None:
        self._window.take_batch(idx)

    def extend_batch(self, other: AdaKVPolicy) -> None:
        self._window.join_batch(other._window)


def _batch(view) -> int:
    for p in view.body_positions():
        if p is not None:
            return int(p.shape[0])
    return 1
