"""``ExpectedAttentionPolicy``: keep the tokens future queries are expected to attend to
(Devoto, Jeblick and Jégou, arXiv 2510.00636; NVIDIA kvpress's ``ExpectedAttentionPress``).

The attention a cached key will receive depends on queries that do not exist yet. Expected
Attention models them as a Gaussian: the mean ``mu`` and covariance ``Sigma`` of the layer's
pre-RoPE queries so far (per query head, the first ``sinks`` positions left out as
outliers), turned to the positions to come by the RoPE rotation averaged over the next
``n_future_positions`` positions, ``R`` (so ``mu -> R mu``, ``Sigma -> R Sigma R^T``). For a
Gaussian query, ``E[exp(q.k / sqrt(d))] = exp(mu.k / sqrt(d) + k^T Sigma k / 2d)``; each query
head takes the softmax of those logits over the body's keys, the heads sharing a KV head
average theirs, and ``use_vnorm`` rescales them as ``(score + epsilon) * ||v||``. Each KV head
keeps its ``budget - protected`` body tokens of highest score
(:func:`expected_attention_scores`, float32).

How it runs in velox: :meth:`ExpectedAttentionPolicy.observe` receives the post-RoPE queries
of every attention call (``VeloxCache.attend``: routed attention only), turns them back to
pre-RoPE at their absolute positions with the layer's RoPE (read from the model by ``bind``,
or from ``rope_base`` for a cache made by hand) and folds them into running moments
(:class:`~velox_expected_attention.stats.QueryStats`). velox-core's ``before_update`` cuts the
cache after each prefill chunk (and, with ``every``, during decode); the cut averages the RoPE
over the ``n_future_positions`` positions after the newest token (``view.offset``: kvpress's
``q_len`` for a prompt) and scores the body.

Deviations from kvpress (also in docs/expected-attention.md):

* **Queries.** kvpress recomputes the pre-RoPE queries from the layer's hidden states
  (``q_proj`` and the q-norm); velox sees the post-RoPE queries the model attends with and
  un-rotates them with the layer's RoPE frequencies (the same vectors, to float32 rounding;
  YaRN's / LongRoPE's constant gain lands on ``mu`` and ``Sigma`` as kvpress's scaled ``cos``
  and ``sin`` put it there).
* **Chunked prefill.** kvpress compresses once, after the prompt, with the moments of the
  whole prompt; here each chunk's cut uses the moments of every prompt query so far (exact
  running sums) and scores the earlier survivors plus the chunk, so peak memory is
  ``budget`` plus one chunk. A prompt in one chunk gets kvpress's rule. mlx-lm's
  ``generate`` feeds the last prompt token as a step of its own: its query is not in the
  prompt's moments.
* **Decode.** kvpress's prefill press does not evict generated tokens; with ``every`` the
  cache is cut again during decode with the moments of every query so far (kvpress's
  ``DecodingPress`` would use only the queries since its last compression). Without
  ``every`` the moments are dropped at the first decode step (no cut will use them).
* **Budget** in tokens per KV head, not a ratio; ``sinks`` (kvpress's ``n_sink``) and
  ``window`` are velox's shared settings.
* **No query.** Without routing a cut raises (the queries never reach the policy); routed
  but before any query reached the cache, a cut keeps the most recent tokens; queries
  seen with no RoPE known make the cut raise, naming ``make_cache`` and ``rope_base``.
"""

from __future__ import annotations

import math
from typing import Any

import mlx.core as mx

from velox_core import RetentionPolicy
from velox_core.codec.prerope import ROPE_SETTINGS, check_rope_settings
from velox_core.ops.rope import RopeSpec, fast_rotate, find_rope, rope_spec
from velox_core.policy.base import require_routed

from .config import check_scoring
from .stats import NAME, QueryStats, average_rotation

__all__ = [
    "ExpectedAttentionPolicy",
    "body_values",
    "expected_attention_scores",
    "model_rope",
]

_HINT = "or pass rope_base=... (mlx.nn.RoPE's settings) to a cache made by hand"


def expected_attention_scores(
    mean: mx.array,
    cov: mx.array | None,
    keys: mx.array,
    values: mx.array | None = None,
    epsilon: float = 0.0,
) -> mx.array:
    """kvpress's score of each key: the softmax over the keys of ``mu.k / sqrt(d) + k^T Sigma k
    / 2d`` per query head (the query moments already turned by the averaged RoPE), averaged
    over the query heads of each KV head; with ``values``, ``(score + epsilon) * ||v||``.

    Args:
        mean: the query heads' mean; the query heads of KV head ``h`` are ``h * R ... h * R +
            R - 1`` (mlx-lm's grouped layout).
        cov: their covariance, or None (kvpress's ``use_covariance=False``).
        keys: post-RoPE keys.
        values: values, or None (``use_vnorm=False``).
        epsilon: added to the scores before the value-norm rescaling.

    Shapes:
        mean ``(B, Hq, D)``, cov ``(B, Hq, D, D)``, keys ``(B, H, T, D)`` with ``Hq % H ==
        0``, values ``(B, H, T, Dv)``; returns float32 ``(B, H, T)``.
    """
    b, hq, d = mean.shape
    h = keys.shape[1]
    if hq % h:
        raise ValueError(f"{NAME}: {hq} query heads is not a multiple of {h} KV heads")
    r = hq // h
    k = keys.astype(mx.float32)
    mu = mean.astype(mx.float32).reshape(b, h, r, d)
    logits = (mu @ mx.swapaxes(k, -1, -2)) / math.sqrt(d)  # (B, H, R, T)
    if cov is not None:
        sigma = cov.astype(mx.float32).reshape(b, h, r, d, d)
        ks = k[:, :, None] @ sigma  # (B, H, R, T, D)
        logits = logits + mx.sum(ks * k[:, :, None], axis=-1) / (2 * d)
    p = mx.mean(mx.softmax(logits, axis=-1, precise=True), axis=2)
    if values is None:
        return p
    v = values.astype(mx.float32)
    return (p + epsilon) * mx.sqrt(mx.sum(v * v, axis=-1))


def body_values(view) -> list[mx.array | None]:
    """Decoded body values, float32, one ``(B, 1, T_h, Dv)`` array per KV head:
    ``PolicyView.body_values``."""
    return view.body_values()


def _is_identity(module: Any) -> bool:
    """Whether a RoPE module leaves vectors as they are (mlx-lm's ``NoPE``)."""
    x = mx.random.normal((1, 1, 3, 8), key=mx.random.key(0))
    try:
        return bool(mx.array_equal(module(x, offset=5), x).item())
    except Exception:
        return False


def model_rope(model: Any, layer: int) -> RopeSpec | None:
    """The RoPE of ``model.layers[layer]``'s attention, or None where the layer has none
    (an attention with ``use_rope`` off, Llama 4's and EXAONE 4's NoPE layers, or a RoPE
    module that changes nothing, SmolLM3's ``NoPE``).

    Raises:
        ValueError: no attention module, or no RoPE module where ``use_rope`` is not off.
        TypeError: a RoPE class velox cannot read (``velox_core.ops.rope.rope_spec``).
    """
    layers = getattr(model, "layers", None)
    if layers is not None and 0 <= layer < len(layers):
        for name in ("self_attn", "attention", "attn"):
            attn = getattr(layers[layer], name, None)
            if attn is not None and not getattr(attn, "use_rope", True):
                return None
    module = find_rope(model, layer, NAME, _HINT)
    try:
        return rope_spec(module, NAME, _HINT)
    except TypeError:
        if _is_identity(module):
            return None
        raise


class ExpectedAttentionPolicy(RetentionPolicy):
    """Expected Attention's retention policy: each KV head keeps the keys of highest expected
    attention under the queries' Gaussian model (times the value norm).

    Args:
        budget: tokens kept per KV head (sinks + body + window), or None (keep all).
        every: during decode, cut once the cache holds ``budget + every`` tokens (None: only
            after prefill chunks, kvpress's prefill press).
        n_future_positions: positions after the newest token over which the RoPE is averaged.
        use_covariance: add the covariance term.
        use_vnorm: rescale by the value norm, ``(score + epsilon) * ||v||``.
        epsilon: added before the value-norm rescaling (finite, >= 0).
        rope_base, rope_traditional, rope_scale, rope_dims: the RoPE of a cache made by hand
            (``bind`` reads the model's; the two must agree when both are given).
    """

    name = "expected-attention"
    settings = ("n_future_positions", "use_covariance", "use_vnorm", "epsilon", *ROPE_SETTINGS)

    def __init__(
        self,
        budget: int | None = None,
        every: int | None = None,
        n_future_positions: int = 512,
        use_covariance: bool = True,
        use_vnorm: bool = True,
        epsilon: float = 0.0,
        rope_base: float | None = None,
        rope_traditional: bool = False,
        rope_scale: float = 1.0,
        rope_dims: int | None = None,
    ):
        super().__init__(budget, every)
        self.n_future_positions, self.use_covariance, self.use_vnorm, self.epsilon = check_scoring(
            n_future_positions, use_covariance, use_vnorm, epsilon
        )
        self.rope_base, self.rope_traditional, self.rope_scale, self.rope_dims = (
            check_rope_settings(rope_base, rope_traditional, rope_scale, rope_dims)
        )
        self.stats = QueryStats(self.use_covariance)
        self._rope: RopeSpec | None = None  # None with _rope_known: a layer without RoPE
        self._rope_known = False
        self._unrotated = False  # queries arrived while no RoPE was known

    # -- the RoPE --------------------------------------------------------------------------
    def _settings_rope(self, dim: int) -> RopeSpec:
        dims = dim if self.rope_dims is None else self.rope_dims
        return RopeSpec.from_base(self.rope_base, dims, self.rope_traditional, self.rope_scale)

    def bind(self, model: Any = None, layer: int | None = None) -> None:
        """Read the RoPE of ``model.layers[layer]`` (``make_cache`` calls it)."""
        if model is None or layer is None:
            return
        spec = model_rope(model, layer)
        if self.rope_base is not None and (
            spec is None or not self._settings_rope(spec.dims).same_as(spec)
        ):
            found = "no RoPE" if spec is None else f"its RoPE ({spec.describe()})"
            raise ValueError(
                f"{NAME}: rope_base={self.rope_base} (and rope_traditional/rope_scale/"
                f"rope_dims) disagree with layer {layer}, which has {found}; leave "
                "rope_base unset to use the model's"
            )
        self._rope, self._rope_known = spec, True

    def rope_for(self, dim: int) -> tuple[bool, RopeSpec | None]:
        """``(known, spec)``: whether the RoPE of heads of ``dim`` channels is known (bound,
        restored or from ``rope_base``), and it (None: none)."""
        if not self._rope_known and self.rope_base is not None:
            self._rope, self._rope_known = self._settings_rope(dim), True
        if self._rope is not None and self._rope.dims > dim:
            raise ValueError(
                f"{NAME}: the RoPE rotates {self._rope.dims} channels, more than a head's {dim}"
            )
        return self._rope_known, self._rope

    # -- the queries ------------------------------------------------------------------------
    def observe(self, view, queries: mx.array, scale: float) -> None:
        """Fold this call's queries (at positions ``offset - L ... offset - 1``, those below
        ``sinks`` left out) into the statistics, turned back to pre-RoPE.

        Without ``every`` a single decode query means the prompt is over: no cut will use the
        statistics, so they are dropped and decode holds no policy state."""
        if self.budget is None:
            return
        n = queries.shape[2]
        if self.every is None and n == 1:
            self.stats.clear()
            return
        start = view.offset - n
        skip = min(max(view.sinks - start, 0), n)
        if skip == n:
            return
        known, spec = self.rope_for(queries.shape[-1])
        if not known:
            self._unrotated = True
            return
        q = queries[:, :, skip:]
        if spec is not None:
            q = fast_rotate(q, mx.array([start + skip], dtype=mx.int32), spec, inverse=True)
        self.stats.add(q)

    # -- choosing ---------------------------------------------------------------------------
    def score(self, view) -> list[mx.array | None]:
        """Per KV head ``(B, T_h)`` float32: kvpress's expected-attention score of each body
        token (rows without statistics: the most recent first)."""
        pos = view.body_positions()
        if any(p is None for p in pos):
            return pos
        recent = [p.astype(mx.float32) for p in pos]
        if self.stats.empty or self.stats.mean.shape[0] != pos[0].shape[0]:
            if self._unrotated:
                raise ValueError(
                    f"{NAME}: the queries must be turned back to pre-RoPE and this cache does "
                    "not know the model's RoPE: build the caches with "
                    f"velox_core.make_cache(model, ...), {_HINT}"
                )
            require_routed(view, NAME, "the queries' statistics choose the tokens to keep")
            return recent  # routed, but no query has reached the cache yet
        d = view.key_dim
        _, spec = self.rope_for(d)
        mean, cov = self.stats.moments()
        rot = average_rotation(spec, d, view.offset, self.n_future_positions)
        mean = mean @ rot.T
        cov = None if cov is None else rot @ cov @ rot.T
        keys, values = view.body_keys(), body_values(view)
        hq, h = mean.shape[1], len(keys)
        if hq % h:
            raise ValueError(f"{NAME}: {hq} query heads is not a multiple of {h} KV heads")
        r = hq // h
        seen = (self.stats.count > 0)[:, None]
        out = []
        for i, (k, v) in enumerate(zip(keys, values)):
            heads = slice(i * r, (i + 1) * r)
            s = expected_attention_scores(
                mean[:, heads],
                None if cov is None else cov[:, heads],
                k,
                v if self.use_vnorm else None,
                self.epsilon,
            )
            out.append(mx.where(seen, s[:, 0], recent[i]))
        return out

    # -- batch rows (called by VeloxCache.filter / extend) ----------------------------------
    def filter_batch(self, idx: mx.array) -> None:
        self.stats.filter_batch(idx)

    def extend_batch(self, other: ExpectedAttentionPolicy) -> None:
        self.stats.extend_batch(other.stats)

    # -- state: the moments (q_mean, q_m2, q_count) and the RoPE (rope_theta, rope_layout) --
    def state(self) -> dict[str, mx.array]:
        out = self.stats.state()
        if self._rope is not None:
            out.update(self._rope.arrays())
        return out

    def meta(self) -> Any:
        return {**super().meta(), "rope_known": self._rope_known, "unrotated": self._unrotated}

    def set_state(self, state: dict[str, mx.array], meta: Any) -> None:
        state = dict(state)
        theta, layout = state.pop("rope_theta", None), state.pop("rope_layout", None)
        stats = {k: state.pop(k) for k in ("q_mean", "q_m2", "q_count") if k in state}
        super().set_state(state, meta)
        if (theta is None) != (layout is None):
            raise ValueError(f"{NAME}: rope_theta and rope_layout go together")
        meta = meta or {}
        if theta is not None:
            self._rope, self._rope_known = RopeSpec.from_arrays(theta, layout), True
        else:
            self._rope, self._rope_known = None, bool(meta.get("rope_known", False))
        self._unrotated = bool(meta.get("unrotated", False))
        self.stats.set_state(stats)
