"""``KVSinkCache``: KIVI's codes, with predicted attention sinks kept exact wherever they are.

Tokens are coded as KIVI codes them (:class:`velox_core.Uniform`: keys per channel in groups
of ``group`` tokens, values per token in groups of ``group`` channels, an fp16 window of the
newest ``window`` tokens passed to the codes ``flush`` at a time). Before an update's tokens
are stored, the sink predictor (:mod:`velox_kvsink.predict`) scores them against the median
key and value norms of the fp16 window and the update itself; the first ``sinks`` tokens and
the tokens scoring ``outlier`` or more (at most ``max_sinks`` per layer) go, exactly as given,
to the cache's fp16 sink store with their absolute positions. They never reach the window or
the codes, so no quantization range (a key channel group's min and max over its ``group``
tokens, a value's per-token groups) ever contains them, and the codes stay whole blocks of
ordinary tokens.

The sink store is out of temporal order (a sink at position 700 sits before the codes of
position 0). Attention without a mask (a decode step) is a softmax over a set of tokens, so
the order does not matter and the cache attends from the codes as KIVI does (sinks | codes |
window, the fused kernels included). Where order matters, it is restored from the stored
positions: ``keys_and_values()`` (what an unrouted model attends) returns every token in
temporal order, and a masked attention whose queries may see a sink of their own chunk (a
routed prefill) attends those in-order tokens.

Batch rows keep their own sinks, the same number per row: an update keeps, in every row, as
many tokens as the row flagging the most (the others take their next highest-scoring tokens).
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import numpy as np

from velox_core import Codec, Packed, PresetCache, Uniform
from velox_core.cache.attention import Segment, attend
from velox_core.cache.store import PackedStore
from velox_core.validation import check_int, check_kv

from .config import KVSinkConfig
from .predict import complement, norms, outlier_scores, select_sinks

__all__ = ["KVSinkCache"]


def _gather(x: mx.array, idx: np.ndarray) -> mx.array:
    """Tokens ``idx`` ``(B, n)`` of each row of ``x`` ``(B, H, T, D)``."""
    if idx.shape[0] == 1:
        return mx.take(x, mx.array(idx[0].astype(np.int32)), axis=2)
    i = mx.array(idx.astype(np.int32))[:, None, :, None]
    return mx.take_along_axis(x, i, axis=2)


class KVSinkCache(PresetCache):
    """KVSink's cache for one layer. Parameters: see :class:`KVSinkConfig`."""

    method = "kvsink"
    Config = KVSinkConfig

    # why a model split by heads cannot use it (VeloxCache.split_refusal)
    mixes_heads = (
        "its sink predictor scores each token over all the layer's KV heads and keeps a "
        "predicted sink exact in every head together"
    )

    def __init__(self, flush: int | None = None, check_finite: bool = False, **params: Any):
        super().__init__(flush=flush, check_finite=check_finite, **params)
        # absolute positions of the sink store's tokens, (B, 1, n) int32, in the order stored
        self._spos = PackedStore(self.step)

    def build(self, cfg: KVSinkConfig) -> dict[str, Any]:
        kb, vb = cfg.widths
        return {
            "key_codec": Uniform(kb, cfg.group, axis="channel"),
            "value_codec": Uniform(vb, cfg.group, axis="token"),
            "window": cfg.window,
            "sinks": 0,  # the sink store is filled by the predictor (first `sinks` included)
        }

    def make_codecs(self, cfg: KVSinkConfig, kb: int, vb: int) -> tuple[Codec, Codec]:
        return Uniform(kb, cfg.group, axis="channel"), Uniform(vb, cfg.group, axis="token")

    def describe(self) -> str:
        t, c = self.tiers[0], self.cfg
        return (
            f"kvsink: K={t.key_codec.describe()} V={t.value_codec.describe()} "
            f"window={self.window} sinks={c.sinks} outlier={c.outlier} max_sinks={c.max_sinks}"
        )

    # -- the sink store ----------------------------------------------------------------------
    def named_stores(self) -> dict[str, PackedStore]:
        out = super().named_stores()
        spos = getattr(self, "_spos", None)
        if spos is not None:
            out["sink.pos"] = spos
        return out

    def sink_positions(self) -> np.ndarray:
        """Absolute positions of the tokens kept exact, per batch row, ascending.

        Shapes: returns ``(B, n)`` int64 (``(0, 0)`` before the first update).
        """
        p = self._spos.view()
        if p is None:
            b = 0 if self.stored.dims is None else self.stored.dims[0]
            return np.zeros((b, 0), dtype=np.int64)
        return np.array(p.data["p"][:, 0]).astype(np.int64)

    def _pick(self, keys: mx.array, values: mx.array) -> np.ndarray | None:
        """The update's tokens to keep exact (indices into its ``T`` tokens, ``(B, n)``)."""
        cfg = self.cfg
        b, _, t, _ = keys.shape
        room = cfg.sinks + cfg.max_sinks - self.stored.sink[0].tokens
        forced = np.arange(self.offset, self.offset + t) < cfg.sinks
        if room <= 0 or (cfg.max_sinks == 0 and not forced.any()):
            return None
        score = np.zeros((b, t))
        if cfg.max_sinks:
            nk, nv = norms(keys), norms(values)
            ref_k, ref_v = nk, nv
            win = self.stored.window[0].view()
            if win is not None:  # the window's ordinary tokens join the baseline
                ref_k = np.concatenate([norms(win.data["x"]), nk], axis=2)
                ref_v = np.concatenate([norms(self.stored.window[1].view().data["x"]), nv], axis=2)
            score = outlier_scores(nk, nv, ref_k, ref_v)
        score[:, forced] = np.inf
        return select_sinks(score, cfg.outlier, room)

    # -- the mlx-lm protocol -----------------------------------------------------------------
    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        """Store new post-RoPE keys and values, predicted sinks exact; return every stored
        token decoded, in temporal order (lazily).

        Shapes:
            keys ``(B, H, T, Dk)``, values ``(B, H, T, Dv)``, fp16, bf16 or fp32.
        """
        if self.check_finite:
            self._refuse_nonfinite(keys, values)
        check_kv(keys, values)
        self._check_first(keys, values)
        keys, values = keys.astype(self.stored.dtype), values.astype(self.stored.dtype)
        picked = self._pick(keys, values)
        if picked is None:
            return super().update_and_fetch(keys, values)
        t, n = keys.shape[2], picked.shape[1]
        self.stored.sink[0].append(self._ident.encode(_gather(keys, picked)))
        self.stored.sink[1].append(self._ident.encode(_gather(values, picked)))
        pos = mx.array((picked + self.offset).astype(np.int32))[:, None, :]
        self._spos.append(Packed({"p": pos}, n))
        self.offset += n
        if n < t:
            rest = complement(picked, t)
            super().update_and_fetch(_gather(keys, rest), _gather(values, rest))
        if self.routed and not self.fetch_decoded:
            return keys, values  # unused: routed attention reads the cache itself
        return self.keys_and_values()

    def _order(self) -> np.ndarray | None:
        """For each temporal slot, the index of its token among sinks | codes | window, per
        row ``(B, S)``; None when that is the identity (no sinks, or only the first ones)."""
        sp = self.sink_positions()
        n = sp.shape[1]
        if n == 0 or np.array_equal(sp, np.broadcast_to(np.arange(n), sp.shape)):
            return None
        s = self.size()
        rest = complement(sp, s)
        return np.argsort(np.concatenate([sp, rest], axis=1), axis=1, kind="stable")

    def keys_and_values(self) -> tuple[mx.array, mx.array]:
        """Every stored token decoded, in temporal order, in the input dtype."""
        k, v = super().keys_and_values()
        order = self._order()
        if order is None:
            return k, v
        return _gather(k, order), _gather(v, order)

    def attend(
        self, queries: mx.array, scale: float, mask=None, sinks: mx.array | None = None
    ) -> mx.array:
        """Attention of ``queries`` over every stored token, one joint softmax: from the codes
        where the order of the tokens does not matter, over the in-order decoded tokens where
        a mask may tell the sinks apart from their neighbours.

        Shapes:
            queries ``(B, Hq, L, Dk)``; returns ``(B, Hq, L, Dv)``.
        """
        if mask is not None and self._order_matters(mask, queries.shape[2]):
            k, v = self.keys_and_values()
            seg = Segment(self._ident, self._ident.encode(k), self._ident, self._ident.encode(v))
            return attend(queries, [seg], scale, mask, sinks, self.fused_above)
        return super().attend(queries, scale, mask, sinks)

    def _order_matters(self, mask, lq: int) -> bool:
        sp = self.sink_positions()
        if sp.shape[1] == 0 or self._order() is None:
            return False
        if isinstance(mask, str):  # causal: only the queries' own chunk is masked
            return lq > 1 and int(sp.max()) >= self.offset - lq
        return True  # an array mask names stored tokens by their temporal slot

    def trim(self, n: int) -> int:
        """Remove the last ``n`` tokens (sinks among them included); returns ``n``."""
        check_int("n", n, minimum=0)
        if n > self.size():
            raise ValueError(f"cannot trim {n} tokens: the cache stores {self.size()}")
        sp = self.sink_positions()
        cut = sp >= self.offset - n
        r = cut.sum(axis=1)
        if r.size and not np.all(r == r[0]):
            raise ValueError(
                "kvsink: cannot trim: the trimmed tokens hold a different number of sinks in "
                "each batch row"
            )
        r = int(r[0]) if r.size else 0
        if r:
            self._planned.clear()
            keep = self.stored.sink[0].tokens - r
            for s in (*self.stored.sink, self._spos):
                s.truncate(keep)
            self.offset -= r
        super().trim(n - r)
        return n
