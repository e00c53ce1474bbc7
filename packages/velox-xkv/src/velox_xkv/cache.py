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

from velox_core.cache.attention import Segment
from velox_core.cache.linked import LinkedLayers
from velox_core.ops.rope import RopeSpec, find_rope, rope_spec, rotate
from velox_core.validation import check_kv

from .config import XKVConfig
from .group import XKVGroup
from .latent import LatentKeys, LatentValues

__all__ = ["XKVCache"]


class XKVCache(LinkedLayers):
    """xKV's cache for one layer (``group``: its :class:`XKVGroup`). Parameters: see
    :class:`XKVConfig`."""

    method = "xkv"
    Config = XKVConfig
    Group = XKVGroup
    no_flush = (
        "prefill chunks join the group's latent once every layer of the group holds them; "
        "decode tokens stay fp16"
    )
    batch_hint = "use layer_group=1 to batch sequences"

    # why a model split by heads cannot use it (VeloxCache.split_refusal)
    mixes_heads = (
        "its shared basis is an SVD of the channels of all KV heads of a group of layers "
        "(its ranks count channels of every head)"
    )

    def __init__(self, **params: Any):
        super().__init__(**params)
        self._lat = 0  # tokens of the group's latent this layer uses (a prefix)
        self._pending = False  # a prefill chunk waits in the window for the group's fit
        self._kc, self._vc = LatentKeys(self.cfg.pre_rope), LatentValues()
        XKVGroup([self])

    def build(self, cfg: XKVConfig) -> dict[str, Any]:
        return {"window": 0, "sinks": 0}  # the cache keeps its own segments (below)

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
        super().bind(model, layer)
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
    def group_fresh(cls, caches: list) -> None:
        """Group the model's fresh xKV caches: layers ``i // layer_group``, same settings."""
        fresh: dict[tuple, list[XKVCache]] = {}
        for i, c in enumerate(caches):
            if not isinstance(c, XKVCache) or c._saved is not None:
                continue
            if len(c.group.members) == 1 and c.stored.dims is None:
                c.layer = i if c.layer is None else c.layer
                key = (c.layer // c.cfg.layer_group, json.dumps(c.config(), sort_keys=True))
                fresh.setdefault(key, []).append(c)
        for members in fresh.values():
            XKVGroup(sorted(members, key=lambda m: m.layer))

    # -- the mlx-lm protocol --------------------------------------------------------------------
    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        """Store new post-RoPE tokens (see the module); return every stored token decoded
        (lazily), or the new tokens while attention is routed and ``fetch_decoded`` is off.

        Shapes: keys ``(B, H, T, Dk)``, values ``(B, H, T, Dv)``.
        """
        check_kv(keys, values)
        first = self.stored.dims is None
        self._check_first(keys, values)
        if first:
            self.check_dims(keys.shape[-1], values.shape[-1], self.stored.dtype)
        keys, values = keys.astype(self.stored.dtype), values.astype(self.stored.dtype)
        t = keys.shape[2]
        self.offset += t
        self.stored.window[0].append(self._ident.encode(keys))
        self.stored.window[1].append(self._ident.encode(values))
        self._planned.clear()
        if t > self.fused_above:
            self._pending = True
            self.group.maybe_fit()
        if self.routed and not self.fetch_decoded:
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
            h = self.stored.dims[1]
            g = self.group
            out.append(
                Segment(self._kc, g.latent(0, self._lat, h), self._vc, g.latent(1, self._lat, h))
            )
        k = self.stored.window[0].view()
        if k is not None:
            out.append(Segment(self._ident, k, self._ident, self.stored.window[1].view()))
        return out

    def size(self) -> int:
        return self._lat + self.stored.window[0].tokens

    def trim(self, n: int) -> int:
        """Remove the newest ``n`` tokens (window first, then the latent's last rows; not
        trimmable: the factorization stays fitted with the trimmed tokens)."""
        out = super().trim(n)
        self._pending = self._pending and self.stored.window[0].tokens > 0
        return out

    def _trim_shared(self, n: int) -> None:
        self._lat -= n
        self.group.shrink()

    # -- memory ----------------------------------------------------------------------------------
    def _layer_stores(self) -> dict:
        return {"win.k": self.stored.window[0], "win.v": self.stored.window[1]}

    def _named_codecs(self) -> dict:
        return {"lat.k": self._kc, "lat.v": self._vc}

    def _codecs(self) -> list:
        return [self._kc, self._vc]

    @property
    def nbytes(self) -> int:
        """Resident bytes: the window (capacity included), ``B_l``, and the group's latent if
        this is the group's first layer (so a model's sum counts the latent once)."""
        return sum(s.nbytes for s in self.named_stores().values()) + sum(
            c.state_nbytes for c in self._codecs()
        )

    @property
    def logical_nbytes(self) -> int:
        return sum(s.logical_nbytes for s in self.named_stores().values()) + sum(
            c.state_nbytes for c in self._codecs()
        )

    # -- state: the group's record (velox_core.cache.linked), and this layer's -----------------
    def _record(self, info: dict, arrays: dict) -> None:
        if self._kc.rope is not None:
            for f, a in self._kc.rope.arrays().items():
                arrays[f"xkv.{f}"] = a
        info.update(lat=self._lat, pending=self._pending, dirty=self.group.dirty)

    def _restore(self, info: dict, arrays: dict) -> None:
        self._lat, self._pending = int(info["lat"]), info["pending"]
        self.group.dirty = bool(info.get("dirty", False))  # A not orthonormal (a trim)
        if "xkv.rope_theta" in arrays:
            self._kc.rope = RopeSpec.from_arrays(
                arrays["xkv.rope_theta"], arrays["xkv.rope_layout"]
            )

    def extend(self, other: XKVCache) -> None:
        self._solo("extend")  # a group's layer refuses batching before the layout check
        mine = (self._lat, self._pending)
        if isinstance(other, XKVCache) and mine != (other._lat, other._pending):
            raise ValueError("extend: both caches must hold the same tokens in the same layout")
        super().extend(other)
