"""``NestedKVPolicy``: key-only eviction by multi-time-scale cosine anomaly (arXiv 2605.26678).

Each kept body token of each KV head is scored from keys alone (no queries, no attention):
its anomaly against the stable anchor (all keys so far), the episodic anchor (its block) and
the current anchor (the ``recent`` keys ending at it), combined per head by the head-adaptive
blend and per token by the surprise-gated route (:func:`~velox_nestedkv.scores.nested_score`).
With ``heads="adaptive"`` the layer's ``budget × H`` tokens are shared among the KV heads
after a per-head safeguard (:func:`~velox_nestedkv.scores.head_budgets`, batch 1); with
``heads="uniform"`` (or batch > 1) every head keeps ``budget`` tokens.

Statistics are absorbed lazily, when an eviction is due: every token that arrived since the
last eviction is still stored then, so its key is read back from the cache (decoded, when the
body is coded) and added to the running sums of :mod:`velox_nestedkv.memory`. Per-token
anomalies are kept beside the stored tokens, in temporal order (body, then window), and are
gathered with them on eviction.

Deviations and interpretations (details in docs/nestedkv.md):

* the paper's full text was not readable here; formulas and constants follow secondary
  descriptions of its Section 2 and Appendix A;
* the paper compresses once after the prompt; velox compresses after every prompt chunk and,
  with ``every`` (an extension), during decode, recomputing weights and gates each time;
* anchors are running sums over every token seen (evicted ones included); normalizations,
  ``Δ``, surprise and head competition run over the tokens being chosen among (kept body and
  new tokens), never over the fp16 sinks and window;
* the block size is fixed at the first compression, from the tokens seen then;
* with ``bits``, statistics use the decoded keys; a trim into absorbed tokens leaves their
  keys in the running sums.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx

from velox_core import RetentionPolicy
from velox_core.policy import top_k_sorted
from velox_core.policy.base import warn_unbounded
from velox_core.validation import check_choice, check_float, check_int

from .memory import absorb
from .scores import PRIOR, block_size, cosine_anomaly, head_budgets, nested_score, unit
from .stored import read, segment

__all__ = ["NestedKVPolicy", "check_prior"]

HEADS = ("adaptive", "uniform")


def check_prior(prior: Any) -> tuple[float, float, float]:
    """Three positive blend priors (stable, episodic, current), returned as a tuple."""
    if not isinstance(prior, (tuple, list)) or len(prior) != 3:
        raise ValueError(
            f"prior must be three positive numbers (stable, episodic, current), got {prior!r}"
        )
    return tuple(
        check_float(f"prior[{i}]", p, minimum=0.0, open_min=True) for i, p in enumerate(prior)
    )


class NestedKVPolicy(RetentionPolicy):
    """NestedKV's retention policy.

    Args:
        budget: tokens kept per KV head (sinks + body + window); with ``heads="adaptive"`` the
            per-head average (the layer keeps ``budget × H``).
        every: during decode, re-compress once ``budget`` is exceeded by ``every`` tokens
            (None: compress only after prefill chunks, as the paper does).
        recent: ``W``, span of the current memory (paper: 64).
        block: episodic block size (None: the paper's ``clip(⌊N/32⌋, 128, 256)`` with ``N``
            the tokens seen at the first compression).
        beta: temperature of the head-adaptive blend (paper: 3.0).
        tau, kappa: threshold and sharpness of the surprise gate (paper: 0.6, 10).
        prior: blend prior of (stable, episodic, current) (paper: 0.4, 0.4, 0.2).
        safeguard: ``α_s``, fraction of its share each head keeps by its own ranking (0.2).
        heads: ``"adaptive"`` (paper: budgets compete across heads) or ``"uniform"``.
    """

    name = "nestedkv"
    settings = ("recent", "block", "beta", "tau", "kappa", "prior", "safeguard", "heads")

    def __init__(
        self,
        budget: int | None = None,
        every: int | None = None,
        *,
        recent: int = 64,
        block: int | None = None,
        beta: float = 3.0,
        tau: float = 0.6,
        kappa: float = 10.0,
        prior: tuple[float, float, float] = PRIOR,
        safeguard: float = 0.2,
        heads: str = "adaptive",
    ):
        super().__init__(budget, every)
        self.recent = check_int("recent", recent, minimum=1)
        self.block = None if block is None else check_int("block", block, minimum=1)
        self.beta = check_float("beta", beta, minimum=0.0)
        self.tau = check_float("tau", tau)
        self.kappa = check_float("kappa", kappa, minimum=0.0)
        self.prior = check_prior(prior)
        self.safeguard = check_float("safeguard", safeguard, minimum=0.0, maximum=1.0)
        self.heads = check_choice("heads", heads, HEADS)
        self._clear()

    def _clear(self) -> None:
        self._seen = 0  # tokens [0, _seen) are in the statistics
        self._block = self.block
        self._stable = self._open = self._recent = None
        self._ac: list[mx.array] = []  # per head (B, n_h) fp16, stored non-sink tokens
        self._ae: list[mx.array] = []
        self._batch = 0
        self._sizes: list[int] = []

    # -- hooks ---------------------------------------------------------------------------------
    def before_update(self, view, incoming: int) -> None:
        after_chunk, self._chunk_pending = self._chunk_pending, incoming > 1
        if view.offset < self._seen:
            self._rewind(view)
        if self.budget is None:
            return
        sizes = view.body_sizes()
        held = view.protected_count() + (sum(sizes) / len(sizes) if sizes else 0)
        over = held - self.budget
        if self.every is None and over >= self.budget and not after_chunk:
            warn_unbounded(self, view.size())  # decode tokens accumulate: say so, once
        if over <= 0 or not (after_chunk or (self.every is not None and over >= self.every)):
            return
        keep = self.select(view, max(self.budget - view.protected_count(), 0))
        view.evict(keep)
        self._gather(keep)

    # -- scoring -------------------------------------------------------------------------------
    def anomalies(self, view) -> list[tuple[mx.array, mx.array, mx.array] | None]:
        """Per KV head, the raw anomalies ``(a_s, a_e, a_c)`` of the body tokens, each
        ``(B, T_h)`` float32 (after absorbing the tokens stored since the last eviction)."""
        st = read(view)
        self._absorb(view, st)
        self._sizes = st.body
        out = []
        for h, (keys, t) in enumerate(zip(st.seqs, st.body)):
            if t == 0:
                out.append(None)
                continue
            a_s = cosine_anomaly(unit(keys[:, :t]), self._stable[:, h, None])
            ae, ac = (x[:, :t].astype(mx.float32) for x in (self._ae[h], self._ac[h]))
            out.append((a_s, ae, ac))
        return out

    def score(self, view) -> list[mx.array | None]:
        """Per KV head, ``a*`` of each body token ``(B, T_h)`` (higher is kept first)."""
        parts = self.anomalies(view)
        knobs = {"beta": self.beta, "tau": self.tau, "kappa": self.kappa, "prior": self.prior}
        if all(p is not None for p in parts) and len({p[0].shape[1] for p in parts}) == 1:
            stacked = [mx.stack([p[i] for p in parts], axis=1) for i in range(3)]
            star = nested_score(*stacked, **knobs).star  # (B, H, T): one call for all heads
            return [star[:, h] for h in range(len(parts))]
        return [None if p is None else nested_score(*p, **knobs).star for p in parts]

    def select(self, view, k: int):
        """Body tokens to keep: a list of per-head indices (adaptive, batch 1) or ``(B, H, k)``."""
        stars = self.score(view)
        if self.heads == "adaptive" and self._batch == 1 and len(stars) > 1:
            empty = mx.zeros((0,), dtype=mx.float32)
            return head_budgets(
                [empty if s is None else s for s in stars], k * len(stars), self.safeguard
            )
        if view.ragged:
            return [mx.zeros((0,), mx.int32) if s is None else top_k_sorted(s[0], k) for s in stars]
        if any(s is None for s in stars):
            return mx.zeros((self._batch, len(stars), 0), dtype=mx.int32)
        return top_k_sorted(mx.stack(stars, axis=1), k)

    # -- statistics ------------------------------------------------------------------------------
    def _absorb(self, view, st) -> None:
        """Add every token stored since the last call to the running statistics."""
        if view.offset <= self._seen:
            return
        sink, seqs = st.sink, st.seqs
        n_sink = 0 if sink is None else max(sink.shape[2] - self._seen, 0)
        if self._block is None:
            self._block = block_size(view.offset)
        if not self._ac:
            first = next(x for x in (sink, *seqs) if x is not None)
            self._batch = first.shape[0]
            self._ac = [mx.zeros((self._batch, 0), mx.float16) for _ in seqs]
            self._ae = [mx.zeros((self._batch, 0), mx.float16) for _ in seqs]
        fresh_n = {(0 if s is None else s.shape[1]) - a.shape[1] for s, a in zip(seqs, self._ac)}
        if len(fresh_n) != 1 or min(fresh_n) < 0:
            raise RuntimeError("nestedkv: the policy's statistics are out of step with the cache")
        n = n_sink + fresh_n.pop()  # the new tokens: newest stored non-sinks, after new sinks
        if n == 0:
            self._seen = view.offset
            return
        new = []
        for h, s in enumerate(seqs):
            tail = [] if n_sink == 0 else [sink[:, h, sink.shape[2] - n_sink :].astype(mx.float32)]
            if s is not None:
                tail.append(s[:, s.shape[1] - (n - n_sink) :])
            new.append(mx.concatenate(tail, axis=1))
        u = unit(mx.stack(new, axis=1))
        self._batch = u.shape[0]
        b = self._block
        r = absorb(u, self._seen, self._stable, self._open, self._recent, self.recent, b)
        start = self._seen - self._seen % b  # first position of the block that was open
        for h, s in enumerate(seqs):
            m = self._ac[h].shape[1]
            ae = self._ae[h]
            tail = min(m, self._seen % b)  # older stored tokens that can lie in that block
            if tail:
                old = unit(s[:, m - tail : m])
                fresh = cosine_anomaly(old, r.first_block[:, h, None])
                in_block = st.pos[h][:, m - tail : m] >= start
                upd = mx.where(in_block, fresh, ae[:, m - tail :].astype(mx.float32))
                ae = mx.concatenate([ae[:, : m - tail], upd.astype(mx.float16)], axis=1)
            self._ae[h] = mx.concatenate([ae, r.a_e[:, h, n_sink:].astype(mx.float16)], axis=1)
            self._ac[h] = mx.concatenate(
                [self._ac[h], r.a_c[:, h, n_sink:].astype(mx.float16)], axis=1
            )
        self._stable, self._open, self._recent = r.stable, r.open, r.recent
        self._seen = view.offset

    def _gather(self, keep) -> None:
        """Keep the statistics of the kept body tokens (the window's follow unchanged)."""
        for h, t in enumerate(self._sizes):
            if isinstance(keep, (list, tuple)):
                pick = lambda a, h=h: a[:, keep[h].astype(mx.int32)]  # noqa: E731
            else:
                pick = lambda a, h=h: mx.take_along_axis(a, keep[:, h].astype(mx.int32), axis=1)  # noqa: E731
            self._ac[h] = mx.concatenate([pick(self._ac[h][:, :t]), self._ac[h][:, t:]], axis=1)
            self._ae[h] = mx.concatenate([pick(self._ae[h][:, :t]), self._ae[h][:, t:]], axis=1)

    def _rewind(self, view) -> None:
        """After a trim into absorbed tokens: drop their per-token statistics (the running
        sums keep their keys; see docs/nestedkv.md)."""
        win = segment(view, "win")
        w = 0 if win is None else win.shape[2]
        for h, t in enumerate(view.body_sizes()):
            self._ac[h], self._ae[h] = self._ac[h][:, : t + w], self._ae[h][:, : t + w]
        self._seen = view.offset

    # -- state ---------------------------------------------------------------------------------
    def state(self) -> dict[str, mx.array]:
        out = {}
        for name in ("stable", "open", "recent"):
            a = getattr(self, f"_{name}")
            if a is not None:
                out[name] = a
        for h, (c, e) in enumerate(zip(self._ac, self._ae)):
            if c.size:
                out[f"a_c.{h}"], out[f"a_e.{h}"] = c, e
        return out

    def meta(self) -> dict[str, Any]:
        return {
            **super().meta(),
            "seen": self._seen,
            "block": self._block,
            "heads": len(self._ac),
            "batch": self._batch,
        }

    def set_state(self, state: dict[str, mx.array], meta: Any) -> None:
        meta = meta or {}
        heads = int(meta.get("heads", 0))
        allowed = {"stable", "open", "recent"} | {f"a_{x}.{h}" for x in "ce" for h in range(heads)}
        unknown = sorted(set(state) - allowed)
        if unknown:
            raise ValueError(f"nestedkv: unknown policy state arrays {unknown}")
        self._clear()
        self._chunk_pending = bool(meta.get("chunk_pending", False))
        self._seen = int(meta.get("seen", 0))
        self._block = meta.get("block", self.block)
        self._batch = int(meta.get("batch", 0))
        self._stable, self._open = state.get("stable"), state.get("open")
        self._recent = state.get("recent")
        empty = mx.zeros((self._batch, 0), mx.float16)
        self._ac = [state.get(f"a_c.{h}", empty) for h in range(heads)]
        self._ae = [state.get(f"a_e.{h}", empty) for h in range(heads)]
