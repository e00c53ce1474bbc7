"""``CurDKVPolicy``: keep the tokens of highest value-guided leverage (arXiv 2509.15038).

Sengupta, Chaudhary and Chakraborty show that the attention weights a token gets do not
bound the error its eviction causes in the attention output ``softmax(Q Kᵀ) V``; the values
matter too. CurDKV keeps the tokens a CUR decomposition of that output would keep: rows of
high leverage in both the keys and the values. Per KV head, each stored token is scored by
:func:`~velox_curdkv.leverage.leverage_scores` (squared norms of the Gaussian-projected key
and value, each normalised within windows of ``local`` positions, multiplied), and the head
keeps its ``budget - sinks - window`` body tokens of highest score; the rest leave memory.
No query is needed (any attention kernel works, routed or not), and each KV head chooses on
its own keys and values, so grouped-query models are scored per KV head as stored.

Deviations from the paper and from its published code (also in docs/curdkv.md):

* **Seeded sketch.** ``G`` is drawn once per cache from ``seed`` (the same ``G`` for every
  head and cut, rebuilt from the seed at load); the reference code draws a fresh unseeded
  ``G`` at each compression. The values get their own ``(Dv, r)`` matrix, from the same
  seed, where the value head dim differs from the key head dim.
* **Cadence.** The paper compresses the prompt once, after prefill, with a keep ratio;
  here ``budget`` counts tokens per KV head and the cache is cut after each prefill chunk
  (and, with ``every``, during decode). The scores are computed from the tokens stored at
  each cut: a local window's normalisation runs over its tokens still in the cache, so a
  prompt fed in several chunks can keep slightly different tokens than one cut over the
  whole prompt (one chunk: the same tokens).
* **Sinks and window.** The reference code sets the first ``num_sinks = 4`` scores to the
  maximum; here they are velox's ``sinks`` (kept as given, counted in ``budget``, default
  4). The stored sinks and window tokens take part in their local windows' normalisation,
  as every token does in the reference code; only the body is scored for eviction.
* With ``bits``, keys and values are scored from their stored codes (decoded).
"""

from __future__ import annotations

import mlx.core as mx

from velox_core import RetentionPolicy
from velox_core.validation import check_int

from .leverage import gaussian_sketch, leverage_scores

__all__ = ["CurDKVPolicy", "body_values"]


def body_values(view) -> list[mx.array | None]:
    """Decoded body values, float32, one ``(B, 1, T_h, Dv)`` array per KV head:
    ``PolicyView.body_values``."""
    return view.body_values()


def _protected(view):
    """Keys, values ``(B, H, n, D)`` (None when empty) and positions ``(n,)`` of the sinks
    and of the window, as stored: ``PolicyView.protected``."""
    return view.protected()


class CurDKVPolicy(RetentionPolicy):
    """CurDKV's retention policy: each KV head keeps its tokens of highest key-times-value
    leverage score.

    Args:
        budget: tokens kept per KV head (sinks + body + window), or None (keep all).
        every: during decode, cut again once the cache holds ``budget + every`` tokens
            (None: only after prefill chunks, as the paper compresses the prompt).
        sketch: columns ``r`` of the Gaussian projection (0: exact squared norms).
        local: positions per normalisation window (0: the whole context).
        seed: seed of the projection.
    """

    name = "curdkv"
    settings = ("sketch", "local", "seed")

    def __init__(
        self,
        budget: int | None = None,
        every: int | None = None,
        sketch: int = 20,
        local: int = 16,
        seed: int = 0,
    ):
        super().__init__(budget, every)
        self.sketch = check_int("sketch", sketch, minimum=0)
        self.local = check_int("local", local, minimum=0)
        if self.local == 1:
            raise ValueError("local must be 0 (the whole context) or >= 2, got 1")
        self.seed = check_int("seed", seed, minimum=0)
        self._g: dict[int, mx.array] = {}

    def projection(self, dim: int) -> mx.array | None:
        """``G`` for vectors of ``dim`` channels: float32 ``(dim, sketch)`` (None when
        ``sketch`` is 0)."""
        if self.sketch == 0:
            return None
        if dim not in self._g:
            self._g[dim] = gaussian_sketch(dim, self.sketch, self.seed)
        return self._g[dim]

    def score(self, view) -> list[mx.array | None]:
        """Per KV head ``(B, T_h)`` float32: the body tokens' leverage scores."""
        keys, values, positions = view.body_keys(), body_values(view), view.body_positions()
        (sk, sv, sp), (wk, wv, wp) = _protected(view)
        windows = view.offset // self.local + 1 if self.local else 1
        out = []
        for h, (k, v, p) in enumerate(zip(keys, values, positions)):
            if k is None:
                out.append(None)
                continue
            b = k.shape[0]
            parts = [(k[:, 0], v[:, 0], p)]
            for pk, pv, pp in ((sk, sv, sp), (wk, wv, wp)):
                if pk is not None:
                    pos = mx.broadcast_to(pp[None], (b, pp.shape[0]))
                    parts.append((pk[:, h].astype(mx.float32), pv[:, h].astype(mx.float32), pos))
            kk, vv, pos = (mx.concatenate(x, axis=1) for x in zip(*parts))
            g_k, g_v = self.projection(kk.shape[-1]), self.projection(vv.shape[-1])
            s = leverage_scores(kk, vv, pos, g_k, g_v, self.local, windows)
            out.append(s[:, : k.shape[2]])
        return out
