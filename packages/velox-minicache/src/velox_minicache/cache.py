"""``MiniCache``: one layer's cache of MiniCache's cross-layer merging (arXiv 2405.14366).

``velox_core.make_cache(model, "minicache:...")`` builds one cache per layer and then calls
:meth:`MiniCache.link_layers` with the whole model's caches, which pairs layers
``S, S+1``, ``S+2, S+3``, ... (``S = start_layer``, by default half the layers) under one
:class:`~velox_minicache.pair.MergedPair` each. A layer of a pair stores its tokens in an fp16
window until the pair merges them (see :mod:`velox_minicache.pair`); attention reads the
layer's merged segment (the pair's directions, its own magnitudes and retained tokens, see
:class:`~velox_minicache.codec.MergedStates`) and its window. Layers outside every pair (before
``S``, a last layer without a partner, a cache made alone) keep every token in fp16, as
velox's plain cache does.

Resident for a pair: the directions once (counted by its first layer), each layer's
magnitudes, retained vectors and window; no restored tensor is kept.

Deviations from the paper (also in docs/minicache.md): the retention threshold's range is the
running one of the tokens merged so far (a prefill in chunks, then decode tokens one at a
time); mlx-lm's batching of separately made caches (``merge``) is refused for a pair's layers
(it joins each layer alone); a batch prefilled together is supported.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import numpy as np

from velox_core import Packed
from velox_core.cache.attention import Segment
from velox_core.cache.linked import LinkedLayers
from velox_core.cache.store import PackedStore
from velox_core.validation import check_kv

from .codec import MergedStates
from .config import MiniCacheConfig
from .pair import MergedPair

__all__ = ["MiniCache"]


class MiniCache(LinkedLayers):
    """MiniCache's cache for one layer (``group``: its :class:`MergedPair`, None while
    unmerged). Parameters: see :class:`MiniCacheConfig`."""

    method = "minicache"
    Config = MiniCacheConfig
    Group = MergedPair
    no_flush = (
        "a pair merges the tokens both its layers hold at its next update; unmerged layers "
        "keep every token in fp16"
    )
    batch_hint = (
        "prefill equal-length sequences together as one batch instead (the caches of "
        "make_cache hold any batch size)"
    )

    @classmethod
    def split_refusal(cls, config: dict, by_heads: bool, pipelined: bool) -> str:
        """Why a model split over processes cannot use this cache ("": it can); see
        :mod:`velox_core.distributed`."""
        if not by_heads or config.get("gamma", 0.05) <= 0:
            return ""
        return (
            "with gamma > 0 its retention threshold is the range of angular distances over all "
            "the heads of a layer pair (gamma=0, merging every token, splits by heads)"
        )

    def __init__(self, **params: Any):
        self._merged = 0  # tokens of the pair's merged store this layer uses (a prefix)
        self._mag = (PackedStore(256), PackedStore(256))  # Packed {"m": (B, H, T)}
        self._ret: list[mx.array | None] = [None, None]  # retained keys, values (N, D)
        self._fresh = True  # made by make_cache (link_layers may pair it), not loaded
        super().__init__(**params)

    def build(self, cfg: MiniCacheConfig) -> dict[str, Any]:
        return {"window": 0, "sinks": 0}  # no codec: unmerged layers keep tokens as given

    def describe(self) -> str:
        c = self.cfg
        where = "unmerged (fp16)" if self.group is None else f"pair layers={self.group.layers}"
        return f"minicache: t={c.t} gamma={c.gamma} start_layer={c.start_layer} {where}"

    @classmethod
    def group_fresh(cls, caches: list) -> None:
        """Pair the model's fresh MiniCache layers: from ``start_layer``, same settings."""
        n = len(caches)
        for i, c in enumerate(caches):
            if not isinstance(c, MiniCache) or c._saved is not None:
                continue
            if c.group is not None or c.stored.dims is not None or not c._fresh:
                continue  # already linked, holding tokens, or loaded: stays as it is
            c.layer = i if c.layer is None else c.layer
            # default: the middle layer, or lower where the model is too shallow for a pair there
            start = max(0, min(n // 2, n - 2)) if c.cfg.start_layer is None else c.cfg.start_layer
            if start > n - 2:
                raise ValueError(
                    f"minicache: start_layer={start} leaves no pair of adjacent layers to merge "
                    f"in a model of {n} layers (at most {n - 2})"
                )
            if i < start or (i - start) % 2 or i + 1 >= n:
                continue  # before the first pair, the second of a pair, or without partner
            other = caches[i + 1]
            if not isinstance(other, MiniCache) or other.config() != c.config():
                what = other.describe() if isinstance(other, MiniCache) else type(other).__name__
                raise ValueError(
                    f"minicache: layer {i} pairs with layer {i + 1}, whose cache is {what}; "
                    "both layers of a pair need MiniCache with the same settings"
                )
            if other.group is not None or other.stored.dims is not None or not other._fresh:
                continue
            other.layer = i + 1 if other.layer is None else other.layer
            MergedPair([c, other])

    # -- the mlx-lm protocol ----------------------------------------------------------------
    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        """Store new post-RoPE tokens; return every stored token restored (lazily), or the new
        tokens while attention is routed and ``fetch_decoded`` is off.

        Shapes: keys ``(B, H, T, Dk)``, values ``(B, H, T, Dv)``.
        """
        if self.group is None:
            return super().update_and_fetch(keys, values)
        check_kv(keys, values)
        self._check_first(keys, values)
        keys, values = keys.astype(self.stored.dtype), values.astype(self.stored.dtype)
        self.group.merge_pending()  # the tokens both layers hold, before the new ones
        self.offset += keys.shape[2]
        self.stored.window[0].append(self._ident.encode(keys))
        self.stored.window[1].append(self._ident.encode(values))
        self._planned.clear()
        if keys.shape[2] > self.fused_above:
            mx.eval(self.stored.window[0].arrays(), self.stored.window[1].arrays())
        if self.routed and not self.fetch_decoded:
            return keys, values  # unused: routed attention reads the cache itself
        return self.keys_and_values()

    def _merged_segment(self) -> Segment:
        pair, t = self.group, self._merged
        if pair.tokens < t:
            raise ValueError(
                f"minicache: layer {self.layer} shares its pair's merged tokens, which this "
                "cache does not hold: load the whole model's caches with velox_core.load_cache"
            )
        codecs, records = [], []
        for kind in (0, 1):
            e = pair.dirs[kind].view().slice(0, t)
            m = self._mag[kind].view().slice(0, t)
            pos, rows = pair.pos[kind], self._ret[kind]
            if pos is not None and t < pair.tokens:  # after a trim of this layer only
                sel = mx.array(np.nonzero(np.array(pos[:, 1]) < t)[0].astype(np.int32))
                pos, rows = pos[sel], rows[sel]
            codecs.append(MergedStates(pos, rows))
            records.append(Packed({**e.data, **m.data}, t))  # e (B,H,T,D), m (B,H,T)
        return Segment(codecs[0], records[0], codecs[1], records[1])

    def segments(self) -> list[Segment]:
        """The layer's merged segment (if any), then its fp16 window."""
        if self.group is None:
            return super().segments()
        out = [self._merged_segment()] if self._merged else []
        k = self.stored.window[0].view()
        if k is not None:
            out.append(Segment(self._ident, k, self._ident, self.stored.window[1].view()))
        return out

    def size(self) -> int:
        if self.group is None:
            return super().size()
        return self._merged + self.stored.window[0].tokens

    def _trim_shared(self, n: int) -> None:
        """The merged tokens' last ``n`` rows (a merged layer is not trimmable: the merged
        directions and the retention range were computed with the trimmed tokens' partners)."""
        self._merged -= n
        for s in self._mag:
            s.truncate(self._merged)
        self.group.shrink()

    # -- memory ---------------------------------------------------------------------------
    def _layer_stores(self) -> dict:
        out = super()._layer_stores()
        out["mag.k"], out["mag.v"] = self._mag
        return out

    def _extra_arrays(self) -> list[mx.array]:
        out = [r for r in self._ret if r is not None]
        if self.group is not None and self.group.owner is self:
            out += list(self.group.shared_arrays().values())
        return out

    @property
    def nbytes(self) -> int:
        """Resident bytes: window and magnitudes (capacity included), retained vectors, and
        the pair's directions and positions if this is the pair's first layer (so a model's
        sum counts them once)."""
        return super().nbytes + sum(a.nbytes for a in self._extra_arrays())

    @property
    def logical_nbytes(self) -> int:
        return super().logical_nbytes + sum(a.nbytes for a in self._extra_arrays())

    # -- state: the pair's record (velox_core.cache.linked), and this layer's ---------------
    def _record(self, info: dict, arrays: dict) -> None:
        for kind, r in zip("kv", self._ret):
            if r is not None:
                arrays[f"mc.ret.{kind}"] = r
        if info["owner"]:
            for name, a in self.group.shared_arrays().items():
                arrays[f"mc.{name}"] = a
        info["merged"] = self._merged

    def _restore(self, info: dict, arrays: dict) -> None:
        self._fresh, self._merged = False, int(info["merged"])
        self._ret = [arrays.get("mc.ret.k"), arrays.get("mc.ret.v")]
        if self.group is not None:
            pre = "mc."
            self.group.set_shared({k[len(pre) :]: a for k, a in arrays.items() if k[:3] == pre})

    def _shares_state(self) -> bool:
        """A pair's layer refuses batching even alone (a copy): its retained positions index
        the batch rows."""
        return self.group is not None
