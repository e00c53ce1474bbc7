"""``AnchorKVCache``: AnchorKV's anchor-residual cache (arXiv 2608.02901).

A preset of :class:`velox_core.VeloxCache` whose prompt is compressed once, at its end:

1. while the prompt arrives (updates of more than one token) every token is kept as given
   (fp16), and attention, routed to the cache (``velox_core.routed(model)`` or
   ``velox_core.generate``), keeps the newest ``window`` queries: the observation window;
2. the first single-token update after it (the first decoded token) compresses the stored
   prompt (:func:`~velox_anchorkv.compress.compress_prompt`) into two records, one for the
   keys and one for the values, and frees its fp16 tokens;
3. every later token is kept as given, never re-anchored (the cache's fp16 window and tier).

Segments in temporal order: the compressed prompt (read by :mod:`velox_anchorkv.codec`),
then the tokens after it. Without routing no query reaches the cache; the prompt's newest
``window`` keys stand in for the queries then (the key-as-query proxy), said by
``observed``.

Deviations from the paper (also in docs/anchorkv.md): tokens after the first decoded one are
never compressed, a later prompt chunk included; metadata widths are int16 indices and
float16 coefficients; residual slots are int32 and their scales float16, each charged to the
budget; the residual codec's absmax normalization is scaled to the unit Gaussian's expected
absmax; attention rebuilds the prompt's keys transiently each step (no fused kernel).
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import numpy as np

from velox_core import PresetCache
from velox_core.cache.attention import attend, decode_segments
from velox_core.cache.planned import check_queries
from velox_core.cache.store import PackedStore
from velox_core.codec.prerope import rope_settings
from velox_core.policy import QueryWindow
from velox_core.validation import check_kv

from .codec import AnchorKeys, AnchorValues
from .compress import compress_prompt
from .config import AnchorKVConfig

__all__ = ["AnchorKVCache"]


class AnchorKVCache(PresetCache):
    """AnchorKV's cache for one layer. Parameters: see :class:`AnchorKVConfig`."""

    method = "anchorkv"
    Config = AnchorKVConfig
    mixes_heads = "its residual budget is shared among the layer's KV heads"

    def build(self, cfg: AnchorKVConfig) -> dict[str, Any]:
        kb, vb = cfg.widths
        self.key_side = AnchorKeys(kb, cfg.seed, **rope_settings(cfg))
        self.value_side = AnchorValues(vb, cfg.seed + 1)
        self.queries = QueryWindow(cfg.window)
        self.prompt = (PackedStore(1), PackedStore(1))  # the compressed prompt's records
        self.pending = False  # a prompt is stored as given and waits for its compression
        self.observed = True  # the compression read real queries (False: key proxies)
        # every token as given until the prompt is compressed, and after it
        return {"window": 0}

    def describe(self) -> str:
        c = self.cfg
        kb, vb = c.widths
        stage = "compressed" if self.compressed else "prompt pending" if self.pending else "empty"
        return (
            f"anchorkv: theta={c.theta:g} window={c.window} anchors={c.anchors:g} rho={c.rho:g} "
            f"residual bits K={kb} V={vb} ({stage})"
        )

    # -- the prompt's compression ------------------------------------------------------------
    @property
    def compressed(self) -> bool:
        """Whether the prompt has been compressed."""
        return self.prompt[0].tokens > 0

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        """Store new tokens (post-RoPE); the first single token after a prompt compresses it
        first. See :meth:`velox_core.VeloxCache.update_and_fetch` for what is returned."""
        if self.stored.dims is None and getattr(keys, "ndim", 0) == 4:
            self.key_side.rope_for(keys.shape[-1])  # no RoPE known: refused before storing
        first = self.pending and not self.compressed and getattr(keys, "ndim", 0) == 4
        if first and keys.shape[2] == 1:
            check_kv(keys, values)
            self._check_first(keys, values)
            self.compress()
        out = super().update_and_fetch(keys, values)
        if not self.compressed and keys.shape[2] > 1:
            self.pending = True
        return out

    def compress(self) -> None:
        """Compress every stored token (the prompt, positions ``0 ... S-1``) into the
        anchor-residual records and free their fp16 copies."""
        if self.compressed:
            raise ValueError("anchorkv: the prompt is compressed already")
        segs = super().segments()
        if not segs:
            raise ValueError("anchorkv: no prompt to compress")
        keys, values = decode_segments(segs, self.stored.dtype)
        s = keys.shape[2]
        queries, q_pos, scale = self._observation(keys, s)
        layer = 0 if self._bound_layer is None else self._bound_layer
        rng = np.random.default_rng([self.cfg.seed, layer])
        out = compress_prompt(
            keys, values, queries, q_pos, scale, self.cfg, self.key_side, self.value_side, rng
        )
        mx.eval(out.keys.arrays(), out.values.arrays())
        self.prompt[0].replace(out.keys)
        self.prompt[1].replace(out.values)
        for store in (*self.stored.coded[0], *self.stored.window, *self.stored.sink):
            store.replace(None)
        self.queries.clear()
        self.pending = False
        self._planned.clear()

    def _observation(self, keys: mx.array, s: int) -> tuple[mx.array, mx.array, float]:
        """The observation queries, their positions and the attention scale: the buffered
        queries that the prompt holds, or the newest ``window`` keys (proxies)."""
        q = self.queries.queries
        if q is not None and q.shape[0] == keys.shape[0] and q.shape[1] % keys.shape[1] == 0:
            first = self.queries.end - q.shape[2]
            seen = min(q.shape[2], s - first)
            if seen > 0 and first >= 0:
                self.observed = True
                pos = mx.arange(first, first + seen, dtype=mx.int32)
                return q[:, :, :seen], pos, self.queries.scale
        self.observed = False
        n = min(self.cfg.window, s)
        return keys[:, :, s - n :], mx.arange(s - n, s, dtype=mx.int32), keys.shape[-1] ** -0.5

    # -- segments and attention ------------------------------------------------------------
    def segments(self):
        """The compressed prompt's segment, then the tokens after it."""
        from velox_core.cache.attention import Segment

        out = super().segments()
        if self.compressed:
            k, v = self.prompt[0].view(), self.prompt[1].view()
            out.insert(0, Segment(self.key_side, k, self.value_side, v))
        return out

    def attend(self, queries: mx.array, scale: float, mask=None, sinks=None) -> mx.array:
        """Attention over every stored token (one softmax); before the prompt is compressed
        the queries are kept as the observation window."""
        if not self.compressed:
            if getattr(queries, "ndim", 0) == 4 and self.stored.dims is not None:
                self.queries.add(self.policy_view, queries, scale)
            return super().attend(queries, scale, mask, sinks)
        check_queries(self.stored, queries)
        return attend(
            queries, self.segments(), scale, mask, sinks, self.fused_above, self.prefill_tile
        )

    def size(self) -> int:
        return super().size() + self.prompt[0].tokens

    # -- trim, bind, state --------------------------------------------------------------------
    def is_trimmable(self) -> bool:
        return False  # a trim into the compressed prompt cannot be undone

    def trim(self, n: int) -> int:
        after = self.size() - self.prompt[0].tokens
        if self.compressed and isinstance(n, int) and after < n <= self.size():
            raise ValueError(
                f"anchorkv: cannot trim {n} tokens: only the {after} after the compressed "
                "prompt can be trimmed"
            )
        return super().trim(n)

    def bind(self, model: Any = None, layer: int | None = None) -> None:
        super().bind(model, layer)
        self.key_side.bind(model, layer)

    def named_stores(self) -> dict[str, PackedStore]:
        return {**super().named_stores(), "prompt.k": self.prompt[0], "prompt.v": self.prompt[1]}

    def _codecs(self) -> list:
        return [*super()._codecs(), self.key_side, self.value_side]

    def _named_codecs(self) -> dict:
        return {**super()._named_codecs(), "prompt.k": self.key_side, "prompt.v": self.value_side}

    @property
    def nbytes(self) -> int:
        return super().nbytes + self.queries_nbytes

    @property
    def logical_nbytes(self) -> int:
        return super().logical_nbytes + self.queries_nbytes

    @property
    def queries_nbytes(self) -> int:
        """Bytes of the buffered observation queries (none once the prompt is compressed)."""
        q = self.queries.queries
        return 0 if q is None else q.nbytes

    def _state_dict(self):
        meta, arrays = super()._state_dict()
        for name, a in self.queries.state().items():
            arrays[f"anchorkv.{name}"] = a
        meta["arrays"] = list(arrays)
        meta["anchorkv"] = {**self.queries.meta(), "pending": self.pending}
        meta["anchorkv"]["observed"] = self.observed
        meta["anchorkv"]["layer"] = self._bound_layer  # seeds the random anchors
        return meta, arrays

    def _load_state_dict(self, meta: dict, arrays: dict) -> None:
        super()._load_state_dict(meta, arrays)
        own = meta.get("anchorkv") or {}
        self.queries.set_state(arrays.get("anchorkv.queries"), own)
        self.pending = bool(own.get("pending", False))
        self.observed = bool(own.get("observed", True))
        layer = own.get("layer")
        self._bound_layer = None if layer is None else int(layer)

    def filter(self, batch_indices) -> None:
        super().filter(batch_indices)
        idx = mx.array(batch_indices) if not isinstance(batch_indices, mx.array) else batch_indices
        self.queries.filter_batch(idx)

    def extend(self, other) -> None:
        if type(other) is type(self) and (self.pending, self.compressed) != (
            other.pending,
            other.compressed,
        ):
            raise ValueError("extend: both caches must be at the same stage of their prompt")
        super().extend(other)
        self.queries.extend_batch(other.queries)
