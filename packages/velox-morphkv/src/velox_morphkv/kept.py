"""``KeptWeights``: the authors' kept window, one row per KV head and query.

The authors' code (``ghadiaravi13/MorphKV``, ``morphkv/models/patch_llama.py``) keeps, per
layer, the attention logits of the ``R`` newest queries over the held tokens
(``attn_cache``, one row per query head and query, in the model's dtype), drops the evicted
tokens' columns at each cut, writes each decode step's logits over the oldest row, and gives
the next token a ``-inf`` column (the older queries cannot see it). Their cut for a KV head
sums the logits of its query heads and takes each row's softmax over the older tokens alone
(the newest ``R`` and the current one left out), then fuses those weights over the rows (sum
or max). That cut reads only the sum over the query heads, so one row per KV head is kept
here, and kept as that softmax's numerators: ``exp(Σ_g l_g - c)`` for some constant ``c`` of
the row, bfloat16 (the authors' rows are in the model's dtype, bfloat16 or float16;
bfloat16's range keeps a token ``e^-80`` below the row's best). A cut then renormalizes each
row over the candidates (a sum and a product, no exponential); the softmax of the summed
logits over the candidates is those numerators over their sum, whatever ``c``. A decode step's
row comes from its attention's weights (``Π_g p_g / max p_g``: the product over the query
heads of each head's softmax weights, each over its largest, is ``exp(Σ_g l_g - c)``),
a prefill chunk's from the summed query ``(Σ_g q_g) · k``.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx

__all__ = ["KeptWeights"]


class KeptWeights:
    """The newest ``size`` queries' softmax numerators over a layer's stored tokens, per KV
    head: ``exp`` of the sum of the KV head's query heads' logits, less a constant of each row
    (the authors' ``attn_cache``, summed over each KV head's query heads).

    Attributes:
        size: the window ``R``: how many of the newest queries' rows are kept.
        weights: bfloat16 ``(B, H, n, C)`` with ``n <= size`` rows (the oldest query first)
            and ``C`` columns: the stored tokens in storage order (sinks, body, window), then
            zero columns held for the tokens stored before the next cut; zero where a row's
            query cannot see the token; or None.
        end: absolute position just after the newest row's query.
        queries: always None (no query is kept; read by ``WindowState``'s hooks).
    """

    dtype = mx.bfloat16

    def __init__(self, size: int):
        self.size = size
        self.weights: mx.array | None = None
        self.end = 0
        self.queries = None
        self._covered: tuple[int, int] | None = None  # (offset, stored tokens) the columns cover

    # -- the window grows ---------------------------------------------------------------------
    def add(self, view, queries: mx.array, scale: float) -> None:
        """The newest ``size`` of one attention call's queries join the window, their rows
        computed here from the stored keys (as attention reads them): ``exp`` of the summed
        query's logits ``(Σ_g q_g) · k`` less the row's largest, zero for the tokens after a
        query in the same call.

        Shapes:
            queries ``(B, Hq, L, D)``, post-RoPE; the call's ``L`` tokens are the newest
            stored (ending at ``view.offset``).
        """
        b, hq, n_call, d = queries.shape
        h, stored = view.kv_heads, view.size()
        if hq % h:
            raise ValueError(f"morphkv: {hq} query heads is not a multiple of {h} KV heads")
        q = queries[:, :, -self.size :]
        m = q.shape[2]
        # Σ_g q_g · k = (Σ_g q_g) · k: the query heads of KV head h are h * R ... h * R + R - 1
        qs = mx.sum((q.astype(mx.float32) * scale).reshape(b, h, hq // h, m, d), axis=2)
        parts = [seg.key_codec.scores(qs, seg.keys) for seg in view.segments()]
        s = parts[0] if len(parts) == 1 else mx.concatenate(parts, axis=-1)  # (B, H, m, S)
        if n_call > 1:  # storage order is position order: query j sees columns <= its own
            col = mx.arange(stored, dtype=mx.int32)
            last = stored - m + mx.arange(m, dtype=mx.int32)  # each row's own column
            s = mx.where(col[None, :] <= last[:, None], s, -mx.inf)
        w = mx.exp(s - mx.max(s, axis=-1, keepdims=True))
        self._join(view, n_call, w)
        if n_call > 1:
            mx.async_eval(self.weights)  # not holding the call's queries

    def add_weights(self, view, weights: mx.array) -> None:
        """A few queries join the window with the softmax weights their attention computed
        (``RetentionPolicy.observe_weights``): each row is the product over the KV head's
        query heads of their weights, each over its largest (``exp(Σ_g l_g - Σ_g max l_g)``).

        Shapes:
            weights float32 ``(B, H, R, L, S)``.
        """
        p = weights if weights.shape[3] <= self.size else weights[:, :, :, -self.size :]
        p = p / mx.maximum(mx.max(p, axis=-1, keepdims=True), 1e-30)
        self._join(view, weights.shape[3], mx.prod(p, axis=2))

    def _join(self, view, n_call: int, rows: mx.array) -> None:
        """``rows`` (float32 ``(B, H, m, S)``) follow the rows kept from before, where those
        cover the stored tokens (:meth:`appended` gave them the call's columns) and their
        queries end where the call starts; otherwise the window starts over from them."""
        stored, start = view.size(), view.offset - n_call
        rows = rows.astype(self.dtype)
        held, keep_old = self.weights, self.size - rows.shape[2]
        if (
            keep_old > 0
            and held is not None
            and self._covered == (view.offset, stored)
            and self.end == start
            and held.shape[:2] == rows.shape[:2]
        ):
            # the old rows are zero past the tokens they saw, the call's tokens among them;
            # the new rows take the columns held past those too
            old = held[:, :, -keep_old:]
            rows = mx.concatenate([_widen(old, stored), _widen(rows, old.shape[3])], axis=2)
        self.weights = rows
        self.end = view.offset
        self._covered = (view.offset, stored)

    def appended(self, view, start: int) -> None:
        """Tokens ``[start, view.offset)`` were just stored (``RetentionPolicy.after_update``):
        rows that covered the tokens before them gain their columns, zero (the rows' queries
        precede them), held since the last cut or added now. Rows that covered other tokens
        (after a trim) are dropped."""
        stored = view.size()
        if self.weights is None or self._covered != (start, stored - (view.offset - start)):
            self.clear()
            return
        self.weights = _widen(self.weights, stored)
        self._covered = (view.offset, stored)

    def clear(self) -> None:
        """Drop the rows (``end`` stays)."""
        self.weights, self._covered = None, None

    # -- a cut ----------------------------------------------------------------------------------
    def valid(self, view) -> bool:
        """Whether the rows cover exactly the stored tokens of this many batch rows."""
        return (
            self.weights is not None
            and self._covered == (view.offset, view.size())
            and self.weights.shape[0] == view.batch
        )

    def votes(self, view, body_pos: mx.array, fusion: str = "sum") -> mx.array | None:
        """The authors' fused weights on the body tokens, per KV head: each row's softmax
        over the body tokens older than the newest ``size`` positions (the candidates: the
        authors' older tokens), its numerators over their sum, summed over the rows
        (``"sum"``) or their maximum (``"max"``). A row with no weight on a candidate votes
        for none.

        Shapes:
            body_pos int ``(B, H, T)``; returns float32 ``(B, H, T)``, or None where the rows
            do not cover the stored tokens (none yet, a trim, other batch rows).
        """
        if not self.valid(view):
            return None
        n_sink, t = view.sink_count(), body_pos.shape[2]
        body = self.weights[..., n_sink : n_sink + t].astype(mx.float32)  # (B, H, n, T)
        older = body_pos < view.offset - self.size
        cand = mx.where(older[:, :, None, :], body, 0.0)
        z = mx.sum(cand, axis=-1, keepdims=True)
        some = z > 0
        inv = mx.where(some, 1.0 / mx.where(some, z, 1.0), 0.0)  # (B, H, n, 1)
        if fusion == "max":
            return mx.max(cand * inv, axis=2)
        return (mx.swapaxes(inv, -1, -2) @ cand)[:, :, 0]  # the sum over the rows, one product

    def kept(self, view, index: mx.array, room: int = 1) -> None:
        """A cut keeps the body tokens at ``index`` (called before ``view.evict(index)``): the
        rows keep, in one gather, the columns of the sinks, those tokens and the window,
        then ``room`` zero columns for the tokens stored before the next cut and one spare
        (the next cut gathers its room from it).

        Shapes:
            index int ``(B, H, k)``, ascending.
        """
        if not self.valid(view):
            self.clear()
            return
        w = self.weights
        b, h, _, c = w.shape
        stored = view.size()
        if c == stored:  # a zero column to gather the room from
            w = _widen(w, stored + 1)
        n_sink = view.sink_count()
        n_win = stored - n_sink - (view.body_sizes() or [0])[0]
        k = index.shape[-1]
        cols = []  # the columns that hold tokens, made only where there are some
        if n_sink:
            cols.append(mx.broadcast_to(mx.arange(n_sink, dtype=mx.int32), (b, h, n_sink)))
        if k:
            cols.append(index.astype(mx.int32) + n_sink if n_sink else index.astype(mx.int32))
        if n_win:
            win = mx.arange(stored - n_win, stored, dtype=mx.int32)
            cols.append(mx.broadcast_to(win, (b, h, n_win)))
        cols.append(mx.full((b, h, room + 1), w.shape[3] - 1, dtype=mx.int32))
        cols = mx.concatenate(cols, axis=2)
        self.weights = mx.take_along_axis(w, cols[:, :, None, :], axis=3)
        self._covered = (view.offset, n_sink + k + n_win)

    # -- batch rows -----------------------------------------------------------------------------
    def filter_batch(self, idx: mx.array) -> None:
        """Keep these batch rows' weights (``VeloxCache.filter``)."""
        if self.weights is not None:
            self.weights = self.weights[idx]

    def extend_batch(self, other: KeptWeights) -> None:
        """Append ``other``'s rows where they cover as many tokens at the same positions;
        otherwise the window starts over from the next queries."""
        a, o = self.weights, other.weights
        if (
            a is None
            or o is None
            or a.shape[1:] != o.shape[1:]
            or self._covered != other._covered
            or self.end != other.end
        ):
            self.clear()
            return
        self.weights = mx.concatenate([a, o], axis=0)

    # -- state ----------------------------------------------------------------------------------
    def state(self, name: str = "weights") -> dict[str, mx.array]:
        """The rows over the stored tokens under ``name``, or nothing."""
        if self.weights is None or self._covered is None:
            return {}
        return {name: self.weights[..., : self._covered[1]]}

    def meta(self) -> dict[str, Any]:
        """``{"q_end": end, "covered": [offset, stored tokens] or None}``."""
        cov = None if self._covered is None else list(self._covered)
        return {"q_end": self.end, "covered": cov}

    def set_state(self, weights: mx.array | None, meta: dict[str, Any] | None) -> None:
        """Restore from :meth:`state`'s array and :meth:`meta`."""
        meta = meta or {}
        if weights is not None and (weights.ndim != 4 or weights.shape[2] > self.size):
            raise ValueError(
                f"the kept weights must be (B, H, n <= {self.size}, S), got {weights.shape}"
            )
        cov = meta.get("covered")
        if weights is not None and (cov is None or int(cov[1]) != weights.shape[3]):
            raise ValueError(
                f"the kept weights' {weights.shape[3]} columns must match meta 'covered' "
                f"(offset, stored tokens), got {cov}"
            )
        self.weights = None if weights is None else weights.astype(self.dtype)
        self._covered = None if weights is None else (int(cov[0]), int(cov[1]))
        self.end = int(meta.get("q_end", 0))

    @property
    def nbytes(self) -> int:
        return 0 if self.weights is None else self.weights.nbytes


def _widen(a: mx.array, width: int) -> mx.array:
    """``a`` with zero columns up to ``width`` (as it is if as wide already)."""
    c = a.shape[3]
    if c >= width:
        return a
    return mx.concatenate([a, mx.zeros((*a.shape[:3], width - c), dtype=a.dtype)], axis=3)
