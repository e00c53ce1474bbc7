"""``XKVCache``: one layer's cache of an xKV layer group (arXiv 2503.18893).

Each layer's cache holds its reconstruction matrices ``B_l`` (keys and values, as the
latent codecs' ``basis``) and an fp16 window; its group (:class:`~velox_xkv.group.XKVGroup`)
holds the token latent ``A`` the layers share. ``velox_core.make_cache(model, "xkv:...")``
builds one cache per layer and then calls :meth:`XKVCache.link_layers` with the whole
model's caches, which puts layers ``0..G-1``, ``G..2G-1``, ... (``G = layer_group``) in one
group each; a cache made alone is a group of one.

Tokens: an update of more than ``fused_above`` (16) tokens is a prefill chunk; it waits in the
layer's fp16 window until every layer of the group holds it, then the group fits (see
:mod:`velox_xkv.group`). Smaller updates (decode steps) stay in the fp16 window, as in the
paper, whose compression applies to the prefill; the next prefill chunk, if any, takes them
into the latent with it. Resident: the group's latent (counted once, by its first layer), each
layer's ``B_l`` and its window; no reconstruction is kept.

Deviations from the paper (also in docs/xkv.md): a prefill in several chunks is factorized by
an exact incremental SVD update per chunk (one SVD when it arrives whole); the latent and the
bases are stored in the storage dtype (fp16), without the authors' optional quantization;
groups are consecutive layers from layer 0; mlx-lm's batching of several sequences (``merge``)
is refused for groups of more than one layer (it copies each layer alone).
"""

from __future__ import annotations

import json
from typing import Any

import mlx.core as mx

from velox_core import PresetCache
from velox_core.cache.attention import Segment
from velox_core.cache.velox import _routing_on, _trim_store
from velox_core.ops.rope import RopeSpec, find_rope, rope_spec, rotate
from velox_core.validation import check_int, check_kv

from .config import XKVConfig
from .group import XKVGroup
from .latent import LatentKeys, LatentValues

__all__ = ["XKVCache"]


class XKVCache(PresetCache):
    """xKV's cache for one layer. Parameters: see :class:`XKVConfig`."""

    method = "xkv"
    Config = XKVConfig

    def __init__(self, flush: int | None = None, **params: Any):
        if flush is not None:
            raise ValueError(
                "xkv: flush does not apply (prefill chunks join the group's latent once every "
                "layer of the group holds them; decode tokens stay fp16)"
            )
        super().__init__(**params)
        self.layer: int | None = None
        self._lat = 0  # tokens of the group's latent this layer uses (a prefix)
        self._pending = False  # a prefill chunk waits in the window for the group's fit
        self._kc, self._vc = LatentKeys(self.cfg.pre_rope), LatentValues()
        self._saved: dict | None = None  # group record of a loaded layer, until linked
        XKVGroup([self])

    def build(self, cfg: XKVConfig) -> dict[str, Any]:
        return {"window": 0, "sinks": 0}  # the cache keeps its own segments (below)

    @classmethod
    def defaults(cls) -> dict[str, Any]:
        return {k: v for k, v in super().defaults().items() if k != "flush"}

    def config(self) -> dict[str, Any]:
        return {k: v for k, v in super().config().items() if k != "flush"}

    def describe(self) -> str:
        c = self.cfg
        layers = [m.layer for m in self.group.present]
        return (
            f"xkv: layer_group={c.layer_group} key_rank={c.key_rank} value_rank={c.value_rank} "
            f"pre_rope={c.pre_rope} group layers={layers}"
        )

    # -- the model: RoPE, and the group --------------------------------------------------------
    def bind(self, model: Any = None, layer: int | None = None) -> None:
        """Record the layer index and read its RoPE (pre-RoPE keys)."""
        self.layer = layer
        if not self.cfg.pre_rope or model is None or layer is None:
            return
        spec = rope_spec(
            find_rope(model, layer, "xkv", "pass rope_base=... or use pre_rope=False"),
            "xkv",
            "pass rope_base=... or use pre_rope=False",
        )
        if self.cfg.rope_base is not None and not self._config_rope(spec.dims).same_as(spec):
            raise ValueError(
                f"xkv: rope_base={self.cfg.rope_base} (and rope_traditional/rope_scale/"
                f"rope_dims) disagree with layer {layer}'s RoPE; leave rope_base unset"
            )
        self._kc.rope = spec

    def _config_rope(self, dims: int) -> RopeSpec:
        c = self.cfg
        return RopeSpec.from_base(
            c.rope_base, c.rope_dims or dims, c.rope_traditional, c.rope_scale
        )

    def check_dims(self, key_dim: int, value_dim: int, dtype: mx.Dtype | None = None) -> None:
        super().check_dims(key_dim, value_dim, dtype)
        if not self.cfg.pre_rope:
            return
        if self._kc.rope is None:
            if self.cfg.rope_base is None:
                raise ValueError(
                    "xkv: pre-RoPE keys need the model's RoPE: build the caches with "
                    "velox_core.make_cache(model, ...), pass rope_base=... for a standalone "
                    "cache, or use pre_rope=False"
                )
            self._kc.rope = self._config_rope(key_dim)
        if self._kc.rope.dims > key_dim:
            raise ValueError(f"xkv: RoPE rotates {self._kc.rope.dims} channels of {key_dim}")

    def unrotate(self, keys: mx.array, start: int) -> mx.array:
        """Post-RoPE keys at positions ``start, ...`` back to pre-RoPE, float32."""
        return rotate(keys, start, self._kc.rope, inverse=True)

    @classmethod
    def link_layers(cls, caches: list) -> None:
        """Group the model's xKV caches (``make_cache``: layers ``i // layer_group``, same
        settings; ``load_cache``: the groups recorded in the file)."""
        fresh: dict[tuple, list[XKVCache]] = {}
        loaded: dict[tuple, list[XKVCache]] = {}
        for i, c in enumerate(caches):
            if not isinstance(c, XKVCache):
                continue
            if c._saved is not None:
                loaded.setdefault(tuple(c._saved["layers"]), []).append(c)
            elif len(c.group.members) == 1 and c._dims is None:
                c.layer = i if c.layer is None else c.layer
                key = (c.layer // c.cfg.layer_group, json.dumps(c.config(), sort_keys=True))
                fresh.setdefault(key, []).append(c)
        for members in fresh.values():
            XKVGroup(sorted(members, key=lambda m: m.layer))
        for layers, members in loaded.items():
            _relink(list(layers), members)

    # -- the mlx-lm protocol --------------------------------------------------------------------
    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        """Store new post-RoPE tokens (see the module); return every stored token decoded
        (lazily), or the new tokens while attention is routed and ``fetch_decoded`` is off.

        Shapes: keys ``(B, H, T, Dk)``, values ``(B, H, T, Dv)``.
        """
        check_kv(keys, values)
        first = self._dims is None
        self._check_first(keys, values)
        if first:
            self.check_dims(keys.shape[-1], values.shape[-1], self._dtype)
        keys, values = keys.astype(self._dtype), values.astype(self._dtype)
        t = keys.shape[2]
        self.offset += t
        self._win[0].append(self._ident.encode(keys))
        self._win[1].append(self._ident.encode(values))
        self._planned.clear()
        if t > self.fused_above:
            self._pending = True
            self.group.maybe_fit()
        if not self.fetch_decoded and _routing_on():
            return keys, values  # unused: routed attention reads the cache itself
        return self.keys_and_values()

    def segments(self) -> list[Segment]:
        """The layer's latent segment (if any), then its fp16 window."""
        out = []
        if self._lat:
            if self.group.tokens < self._lat:
                raise ValueError(
                    f"xkv: layer {self.layer} shares its group's latent, which this cache "
                    "does not hold: load the whole model's caches with velox_core.load_cache"
                )
            h = self._dims[1]
            g = self.group
            out.append(
                Segment(self._kc, g.latent(0, self._lat, h), self._vc, g.latent(1, self._lat, h))
            )
        k = self._win[0].view()
        if k is not None:
            out.append(Segment(self._ident, k, self._ident, self._win[1].view()))
        return out

    def size(self) -> int:
        return self._lat + self._win[0].tokens

    def is_trimmable(self) -> bool:
        """False: a trim into the latent leaves the factorization fitted with the trimmed tokens,
        not the one a cache that never saw them would hold (:meth:`trim` still removes them)."""
        return False

    def trim(self, n: int) -> int:
        """Remove the newest ``n`` tokens (window first, then the latent's last rows)."""
        check_int("n", n, minimum=0)
        if n > self.size():
            raise ValueError(f"cannot trim {n} tokens: the cache stores {self.size()}")
        left = _trim_store(self._win, n)
        if left:
            self._lat -= left
            self.group.shrink()
        self._pending = self._pending and self._win[0].tokens > 0
        self.offset -= n
        self._planned.clear()
        return n

    # -- memory ----------------------------------------------------------------------------------
    def _named_stores(self) -> dict:
        out = {"win.k": self._win[0], "win.v": self._win[1]}
        if self.group.owner is self:  # the shared latent, recorded once for the group
            out["lat.k"], out["lat.v"] = self.group.store
        return out

    def _named_codecs(self) -> dict:
        return {"lat.k": self._kc, "lat.v": self._vc}

    def _codecs(self) -> list:
        return [self._kc, self._vc]

    @property
    def nbytes(self) -> int:
        """Resident bytes: the window (capacity included), ``B_l``, and the group's latent if
        this is the group's first layer (so a model's sum counts the latent once)."""
        return sum(s.nbytes for s in self._named_stores().values()) + sum(
            c.state_nbytes for c in self._codecs()
        )

    @property
    def logical_nbytes(self) -> int:
        return sum(s.logical_nbytes for s in self._named_stores().values()) + sum(
            c.state_nbytes for c in self._codecs()
        )

    # -- state -------------------------------------------------------------------------------------
    def _state_dict(self, detached: bool = False) -> tuple[dict, dict[str, mx.array]]:
        """The cache's record; ``detached`` records it as a group of its own (latent included)."""
        meta, arrays = super()._state_dict()
        if detached and self.group.owner is not self:
            for kind, s in zip("kv", self.group.store):
                v = s.view()
                if v is not None:
                    meta["stores"][f"lat.{kind}"] = {
                        "tokens": v.tokens,
                        "block": 1,
                        "per_block": [],
                        "fields": ["a"],
                    }
                    arrays[f"store.lat.{kind}.a"] = v.data["a"]
        if self._kc.rope is not None:
            for f, a in self._kc.rope.arrays().items():
                arrays[f"xkv.{f}"] = a
        solo = detached or len(self.group.present) == 1
        meta["xkv"] = {
            "layer": self.layer,
            "layers": [self.layer] if solo else [m.layer for m in self.group.present],
            "owner": solo or self.group.owner is self,
            "lat": self._lat,
            "pending": self._pending,
        }
        meta["arrays"] = list(arrays)
        return meta, arrays

    def _load_state_dict(self, meta: dict, arrays: dict[str, mx.array]) -> None:
        info = meta.get("xkv")
        if not isinstance(info, dict):
            raise ValueError("xkv: the state has no xkv record")
        XKVGroup([self])  # a group of its own; load_cache links the recorded group again
        super()._load_state_dict(meta, arrays)  # a layer recorded without the latent has none
        self.layer, self._lat, self._pending = info["layer"], int(info["lat"]), info["pending"]
        if "xkv.rope_theta" in arrays:
            self._kc.rope = RopeSpec.from_arrays(
                arrays["xkv.rope_theta"], arrays["xkv.rope_layout"]
            )
        self._saved = info if len(info["layers"]) > 1 else None

    def copy(self) -> XKVCache:
        """An independent cache of this layer, as a group of its own (holding the latent)."""
        meta, arrays = self._state_dict(detached=True)
        out = type(self).from_state([json.dumps(meta), *arrays.values()])
        out.fetch_decoded = self.fetch_decoded
        return out

    def __deepcopy__(self, memo) -> XKVCache:
        """Copies of a model's caches made in one deepcopy share one copy of each group."""
        out = self.copy()
        memo[id(self)] = out
        if len(self.group.members) > 1:
            clone = memo.get(id(self.group))
            if clone is None:
                clone = memo[id(self.group)] = XKVGroup([None] * len(self.group.members))
                clone.store, clone.dirty = out.group.store, self.group.dirty
            clone.members[self.member] = out
            out.group, out.member = clone, self.member
        return out

    # -- batching: a cross-layer group cannot be batched one layer at a time --------------------
    def _solo(self, what: str) -> None:
        if len(self.group.members) > 1:
            raise ValueError(
                f"xkv: {what} is not supported for a layer of a cross-layer group "
                f"(layers {[m.layer for m in self.group.present]} share one latent and mlx-lm "
                "batches each layer alone); use layer_group=1 to batch sequences"
            )

    def filter(self, batch_indices) -> None:
        self._solo("filter")
        super().filter(batch_indices)

    def extend(self, other: XKVCache) -> None:
        self._solo("extend")
        other._solo("extend")
        if self._lat != other._lat or self._pending != other._pending:
            raise ValueError("extend: both caches must hold the same tokens in the same layout")
        super().extend(other)

    @classmethod
    def merge(cls, caches: list):
        for c in caches:
            if isinstance(c, XKVCache):
                c._solo("merge (batching sequences)")
        return super().merge(caches)


def _relink(layers: list, members: list[XKVCache]) -> None:
    """Rebuild a loaded group: its recorded layers, the latent from the owner's record."""
    by_layer = {m.layer: m for m in members}
    owner = next((m for m in members if m._saved["owner"]), None)
    if owner is None or set(by_layer) != set(layers):
        missing = sorted(set(layers) - set(by_layer), key=str)
        raise ValueError(
            f"xkv: the file holds layers {sorted(by_layer, key=str)} of group "
            f"{layers}, missing {missing} or the group's latent"
        )
    store = owner.group.store
    group = XKVGroup([by_layer[i] for i in layers])
    group.store = store
    for m in members:
        m._saved = None
    if group.owner is not owner:
        raise ValueError("xkv: the group's latent must be recorded by its first layer")
