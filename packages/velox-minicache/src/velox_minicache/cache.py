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

import json
from typing import Any

import mlx.core as mx
import numpy as np

from velox_core import Packed, PackedStore, PresetCache
from velox_core.cache.attention import Segment
from velox_core.cache.velox import _routing_on, _trim_store
from velox_core.validation import check_int, check_kv

from .codec import MergedStates
from .config import MiniCacheConfig
from .pair import MergedPair

__all__ = ["MiniCache"]


class MiniCache(PresetCache):
    """MiniCache's cache for one layer. Parameters: see :class:`MiniCacheConfig`."""

    method = "minicache"
    Config = MiniCacheConfig

    def __init__(self, flush: int | None = None, **params: Any):
        if flush is not None:
            raise ValueError(
                "minicache: flush does not apply (a pair merges the tokens both its layers "
                "hold at its next update; unmerged layers keep every token in fp16)"
            )
        self.pair: MergedPair | None = None  # None: not merged, every token fp16
        self.member = 0
        self._merged = 0  # tokens of the pair's merged store this layer uses (a prefix)
        self._mag = (PackedStore(256), PackedStore(256))  # Packed {"m": (B, H, T)}
        self._ret: list[mx.array | None] = [None, None]  # retained keys, values (N, D)
        self._saved: dict | None = None  # pair record of a loaded layer, until linked
        self._fresh = True  # made by make_cache (link_layers may pair it), not loaded
        super().__init__(**params)
        self.layer: int | None = None

    def build(self, cfg: MiniCacheConfig) -> dict[str, Any]:
        return {"window": 0, "sinks": 0}  # no codec: unmerged layers keep tokens as given

    @classmethod
    def defaults(cls) -> dict[str, Any]:
        return {k: v for k, v in super().defaults().items() if k != "flush"}

    def config(self) -> dict[str, Any]:
        return {k: v for k, v in super().config().items() if k != "flush"}

    def describe(self) -> str:
        c = self.cfg
        where = f"pair layers={self.pair.layers}" if self.pair is not None else "unmerged (fp16)"
        return f"minicache: t={c.t} gamma={c.gamma} start_layer={c.start_layer} {where}"

    def bind(self, model: Any = None, layer: int | None = None) -> None:
        self.layer = layer

    @classmethod
    def link_layers(cls, caches: list) -> None:
        """Pair the model's MiniCache layers (``make_cache``: from ``start_layer``, same
        settings; ``load_cache``: the pairs recorded in the file)."""
        n = len(caches)
        loaded: dict[tuple, list[MiniCache]] = {}
        for i, c in enumerate(caches):
            if not isinstance(c, MiniCache):
                continue
            if c._saved is not None:
                loaded.setdefault(tuple(c._saved["layers"]), []).append(c)
                continue
            if c.pair is not None or c._dims is not None or not c._fresh:
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
            if other.pair is not None or other._dims is not None or not other._fresh:
                continue
            other.layer = i + 1 if other.layer is None else other.layer
            MergedPair([c, other])
        for layers, members in loaded.items():
            _relink(list(layers), members)

    # -- the mlx-lm protocol ----------------------------------------------------------------
    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        """Store new post-RoPE tokens; return every stored token restored (lazily), or the new
        tokens while attention is routed and ``fetch_decoded`` is off.

        Shapes: keys ``(B, H, T, Dk)``, values ``(B, H, T, Dv)``.
        """
        if self.pair is None:
            return super().update_and_fetch(keys, values)
        check_kv(keys, values)
        self._check_first(keys, values)
        keys, values = keys.astype(self._dtype), values.astype(self._dtype)
        self.pair.merge_pending()  # the tokens both layers hold, before the new ones
        self.offset += keys.shape[2]
        self._win[0].append(self._ident.encode(keys))
        self._win[1].append(self._ident.encode(values))
        self._planned.clear()
        if keys.shape[2] > self.fused_above:
            mx.eval(self._win[0].arrays(), self._win[1].arrays())
        if not self.fetch_decoded and _routing_on():
            return keys, values  # unused: routed attention reads the cache itself
        return self.keys_and_values()

    def _merged_segment(self) -> Segment:
        pair, t = self.pair, self._merged
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
        if self.pair is None:
            return super().segments()
        out = [self._merged_segment()] if self._merged else []
        k = self._win[0].view()
        if k is not None:
            out.append(Segment(self._ident, k, self._ident, self._win[1].view()))
        return out

    def size(self) -> int:
        if self.pair is None:
            return super().size()
        return self._merged + self._win[0].tokens

    def is_trimmable(self) -> bool:
        """An unmerged layer's trim is exact; a merged layer's is not (the merged directions
        and the retention range were computed with the trimmed tokens' partners)."""
        return self.pair is None and super().is_trimmable()

    def trim(self, n: int) -> int:
        """Remove the newest ``n`` tokens (window first, then the merged tokens' last rows)."""
        if self.pair is None:
            return super().trim(n)
        check_int("n", n, minimum=0)
        if n > self.size():
            raise ValueError(f"cannot trim {n} tokens: the cache stores {self.size()}")
        left = _trim_store(self._win, n)
        if left:
            self._merged -= left
            for s in self._mag:
                s.truncate(self._merged)
            self.pair.shrink()
        self.offset -= n
        self._planned.clear()
        return n

    # -- memory -----------------------------------------------------------------------------
    def _named_stores(self) -> dict:
        out = super()._named_stores()
        out["mag.k"], out["mag.v"] = self._mag
        if self.pair is not None and self.pair.owner is self:  # shared: recorded once
            out["dir.k"], out["dir.v"] = self.pair.dirs
        return out

    def _extra_arrays(self) -> list[mx.array]:
        out = [r for r in self._ret if r is not None]
        if self.pair is not None and self.pair.owner is self:
            out += list(self.pair.shared_arrays().values())
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

    # -- state ------------------------------------------------------------------------------
    def _state_dict(self, detached: bool = False) -> tuple[dict, dict[str, mx.array]]:
        """The cache's record; ``detached`` records a pair's layer as a pair of its own (the
        shared arrays included)."""
        meta, arrays = super()._state_dict()
        pair = self.pair
        if pair is not None and detached and pair.owner is not self:
            for kind, s in zip("kv", pair.dirs):
                v = s.view()
                if v is not None:
                    meta["stores"][f"dir.{kind}"] = {
                        "tokens": v.tokens,
                        "block": 1,
                        "per_block": [],
                        "fields": ["e"],
                    }
                    arrays[f"store.dir.{kind}.e"] = v.data["e"]
        for kind, r in zip("kv", self._ret):
            if r is not None:
                arrays[f"mc.ret.{kind}"] = r
        if pair is not None and (detached or pair.owner is self):
            for name, a in pair.shared_arrays().items():
                arrays[f"mc.{name}"] = a
        solo = detached or (pair is not None and len(pair.present) == 1)
        meta["minicache"] = {
            "layer": self.layer,
            "layers": None if pair is None else ([self.layer] if solo else pair.layers),
            "owner": pair is not None and (solo or pair.owner is self),
            "merged": self._merged,
        }
        meta["arrays"] = list(arrays)
        return meta, arrays

    def _load_state_dict(self, meta: dict, arrays: dict[str, mx.array]) -> None:
        info = meta.get("minicache")
        if not isinstance(info, dict):
            raise ValueError("minicache: the state has no minicache record")
        self.pair, self._fresh = None, False
        if info["layers"] is not None:
            MergedPair([self])  # a pair of its own; load_cache links the recorded pair again
        super()._load_state_dict(meta, arrays)
        self.layer, self._merged = info["layer"], int(info["merged"])
        self._ret = [arrays.get("mc.ret.k"), arrays.get("mc.ret.v")]
        if self.pair is not None:
            pre = "mc."
            self.pair.set_shared({k[len(pre) :]: a for k, a in arrays.items() if k[:3] == pre})
        layers = info["layers"]
        self._saved = info if layers is not None and len(layers) > 1 else None

    def copy(self) -> MiniCache:
        """An independent cache of this layer (a pair's layer: a pair of its own, holding the
        shared arrays; its new tokens then stay fp16, having no partner)."""
        meta, arrays = self._state_dict(detached=True)
        out = type(self).from_state([json.dumps(meta), *arrays.values()])
        out.fetch_decoded = self.fetch_decoded
        return out

    def __deepcopy__(self, memo) -> MiniCache:
        """Copies of a model's caches made in one deepcopy share one copy of each pair."""
        out = self.copy()
        memo[id(self)] = out
        if self.pair is not None and len(self.pair.members) > 1:
            clone = memo.get(id(self.pair))
            if clone is None:
                clone = memo[id(self.pair)] = MergedPair([None] * len(self.pair.members))
                clone.dirs = out.pair.dirs
                clone.set_shared(out.pair.shared_arrays())
            clone.members[self.member] = out
            out.pair, out.member = clone, self.member
        return out

    # -- batching: a merged pair cannot be batched one layer at a time ----------------------
    def _solo(self, what: str) -> None:
        if self.pair is not None:
            raise ValueError(
                f"minicache: {what} is not supported for a layer of a merged pair (layers "
                f"{self.pair.layers} share merged tokens and mlx-lm batches each layer alone); "
                "prefill equal-length sequences together as one batch instead (the caches of "
                "make_cache hold any batch size)"
            )

    def filter(self, batch_indices) -> None:
        self._solo("filter")
        super().filter(batch_indices)

    def extend(self, other: MiniCache) -> None:
        self._solo("extend")
        other._solo("extend")
        super().extend(other)

    @classmethod
    def merge(cls, caches: list):
        for c in caches:
            if isinstance(c, MiniCache):
                c._solo("merge (batching sequences)")
        return super().merge(caches)


def _relink(layers: list, members: list[MiniCache]) -> None:
    """Rebuild a loaded pair: its recorded layers, the shared arrays from the owner's record."""
    by_layer = {m.layer: m for m in members}
    owner = next((m for m in members if m._saved["owner"]), None)
    if owner is None or set(by_layer) != set(layers):
        missing = sorted(set(layers) - set(by_layer), key=str)
        raise ValueError(
            f"minicache: the file holds layers {sorted(by_layer, key=str)} of pair {layers}, "
            f"missing {missing} or the pair's shared arrays"
        )
    dirs, shared = owner.pair.dirs, owner.pair.shared_arrays()
    pair = MergedPair([by_layer[i] for i in layers])
    pair.dirs = dirs
    pair.set_shared(shared)
    for m in members:
        m._saved = None
    if pair.owner is not owner:
        raise ValueError("minicache: the pair's shared arrays must be recorded by its first layer")
