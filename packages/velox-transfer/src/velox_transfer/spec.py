"""What a mapper records of each model, and its caches read in content space.

A model's spec is, per attention layer, its KV heads, key and value head dims and its RoPE
(:class:`velox_core.ops.rope.RopeSpec`: frequencies, rotated dims, pair layout), read from
the model itself (a one-token probe forward gives the cache shapes, ``find_rope`` the RoPE).
Keys in a cache are post-RoPE; :func:`layer_features` turns them back at their absolute
positions (content space), so that a mapping fitted at some positions holds at any other.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import KVCache

from velox_core.artifacts import fingerprint, identity
from velox_core.ops.rope import RopeSpec, find_rope, rope_spec, rotate

__all__ = ["LayerSpec", "ModelSpec", "layer_features", "read_caches", "split_outputs"]

METHOD = "transfer"


@dataclass(frozen=True)
class LayerSpec:
    """One attention layer: ``kv_heads`` heads of ``key_dim``/``value_dim`` channels."""

    kv_heads: int
    key_dim: int
    value_dim: int
    rope: RopeSpec

    @property
    def features(self) -> int:
        """Width of the layer's row in content space: keys then values of every head."""
        return self.kv_heads * (self.key_dim + self.value_dim)

    def to_json(self) -> dict[str, Any]:
        return {
            "kv_heads": self.kv_heads,
            "key_dim": self.key_dim,
            "value_dim": self.value_dim,
            "rope": {
                "dims": self.rope.dims,
                "traditional": self.rope.traditional,
                "theta": [float(t) for t in self.rope.theta],
            },
        }

    @staticmethod
    def from_json(d: dict[str, Any]) -> LayerSpec:
        r = d["rope"]
        rope = RopeSpec(
            np.asarray(r["theta"], dtype=np.float32), int(r["dims"]), bool(r["traditional"])
        )
        out = LayerSpec(int(d["kv_heads"]), int(d["key_dim"]), int(d["value_dim"]), rope)
        out.validate("manifest")
        return out

    def validate(self, where: str) -> None:
        """Refuse a geometry the mapping does not handle (``ValueError``)."""
        if min(self.kv_heads, self.key_dim, self.value_dim) < 1:
            raise ValueError(f"{where}: kv_heads, key_dim and value_dim must be positive")
        d = self.rope.dims
        if d < 2 or d % 2 or d > self.key_dim or self.rope.theta.shape != (d // 2,):
            raise ValueError(
                f"{where}: a RoPE of {d} rotated dims (theta {self.rope.theta.shape}) on keys of "
                f"{self.key_dim} channels; velox-transfer handles an even number of rotated "
                "dims, at most the key head dim, with one frequency per pair"
            )


@dataclass(frozen=True)
class ModelSpec:
    """A model's identity (``velox_core.artifacts``) and its attention layers' specs."""

    fingerprint: str
    identity: dict[str, Any]
    layers: tuple[LayerSpec, ...]

    @staticmethod
    def of(model: Any, role: str = "model") -> ModelSpec:
        """Read ``model``'s spec.

        Raises:
            ValueError: a layer keeps another cache than mlx-lm's ``KVCache`` (sliding window,
                SSM state), or has a RoPE velox-transfer cannot undo (scaling whose frequencies
                depend on the sequence length, such as dynamic NTK), or no RoPE module.
        """
        own = getattr(type(model), "make_cache", None)  # the class's, not velox's install
        caches = own(model) if own is not None else [KVCache() for _ in model.layers]
        for i, c in enumerate(caches):
            if type(c) is not KVCache:
                raise ValueError(
                    f"{role}: layer {i} keeps a {type(c).__name__}; velox-transfer maps only "
                    "full-attention layers (mlx-lm KVCache)"
                )
        model(mx.array([[0]]), cache=caches)  # a one-token probe: the cache shapes
        layers = []
        for i, c in enumerate(caches):
            k, v = c.keys_and_values()
            try:
                rope = rope_spec(find_rope(model, i, method=METHOD), method=METHOD)
            except TypeError as e:
                raise ValueError(f"{role}: layer {i}: {e}") from None
            spec = LayerSpec(int(k.shape[1]), int(k.shape[3]), int(v.shape[3]), rope)
            spec.validate(f"{role} layer {i}")
            layers.append(spec)
        return ModelSpec(fingerprint(model), identity(model), tuple(layers))

    def to_json(self) -> dict[str, Any]:
        return {
            "fingerprint": self.fingerprint,
            "identity": self.identity,
            "layers": [s.to_json() for s in self.layers],
        }

    @staticmethod
    def from_json(d: dict[str, Any]) -> ModelSpec:
        layers = tuple(LayerSpec.from_json(x) for x in d["layers"])
        if not layers:
            raise ValueError("manifest: a model spec without layers")
        return ModelSpec(str(d["fingerprint"]), dict(d["identity"]), layers)


def read_caches(caches: list, spec: ModelSpec, role: str = "source") -> list[tuple]:
    """Each layer's stored ``(keys, values)`` (post-RoPE, positions ``0 .. T-1``).

    Accepts mlx-lm ``KVCache`` and velox caches that evicted nothing (decoded here).

    Raises:
        TypeError: another cache class (rotating, quantized, SSM state).
        ValueError: a count, shape or length that does not match ``spec``.
    """
    from velox_core import VeloxCache

    if not isinstance(caches, (list, tuple)) or len(caches) != len(spec.layers):
        got = len(caches) if isinstance(caches, (list, tuple)) else type(caches).__name__
        raise ValueError(f"{role} caches: expected a list of {len(spec.layers)}, got {got}")
    out, length = [], None
    for i, (c, s) in enumerate(zip(caches, spec.layers)):
        if type(c) is KVCache:
            if c.keys is None:
                raise ValueError(f"{role} cache {i} is empty")
            k, v = c.keys_and_values()
        elif isinstance(c, VeloxCache):
            if c.empty() or c.size() != c.offset:
                raise ValueError(
                    f"{role} cache {i} holds {c.size()} of {c.offset} tokens; velox-transfer "
                    "needs every token at its position (no eviction)"
                )
            k, v = c.keys_and_values()
        else:
            raise TypeError(
                f"{role} cache {i} is a {type(c).__name__}; velox-transfer reads mlx-lm KVCache "
                "or velox caches that keep every token"
            )
        if k.ndim != 4 or (k.shape[1], k.shape[3], v.shape[3]) != (
            s.kv_heads,
            s.key_dim,
            s.value_dim,
        ):
            raise ValueError(
                f"{role} cache {i}: keys {tuple(k.shape)} / values {tuple(v.shape)} do not match "
                f"the mapper's (kv_heads, key_dim, value_dim) = "
                f"({s.kv_heads}, {s.key_dim}, {s.value_dim})"
            )
        if length is None:
            length = k.shape[2]
        elif k.shape[2] != length:
            raise ValueError(f"{role} caches hold different lengths ({length} and {k.shape[2]})")
        out.append((k, v))
    return out


def layer_features(keys: mx.array, values: mx.array, start: int, spec: LayerSpec) -> mx.array:
    """One layer's tokens in content space: RoPE undone on keys, heads side by side.

    Shapes:
        keys ``(B, H, T, Dk)`` post-RoPE at positions ``start ..``, values ``(B, H, T, Dv)``;
        returns float32 ``(B, T, H*Dk + H*Dv)``: every head's key, then every head's value.
    """
    b, h, t, dk = keys.shape
    kc = rotate(keys, start, spec.rope, inverse=True)
    kc = kc.transpose(0, 2, 1, 3).reshape(b, t, h * dk)
    vc = values.astype(mx.float32).transpose(0, 2, 1, 3).reshape(b, t, h * values.shape[3])
    return mx.concatenate([kc, vc], axis=-1)


def split_outputs(y: mx.array, start: int, spec: LayerSpec, dtype: mx.Dtype) -> tuple:
    """Mapped content-space rows back to a layer's cache: target RoPE applied to the keys.

    Shapes:
        y ``(B, T, H*Dk + H*Dv)`` (the layout of :func:`layer_features`); returns keys
        ``(B, H, T, Dk)`` and values ``(B, H, T, Dv)`` in ``dtype``.
    """
    b, t, _ = y.shape
    h, dk, dv = spec.kv_heads, spec.key_dim, spec.value_dim
    k = y[..., : h * dk].reshape(b, t, h, dk).transpose(0, 2, 1, 3)
    v = y[..., h * dk :].reshape(b, t, h, dv).transpose(0, 2, 1, 3)
    return rotate(k, start, spec.rope).astype(dtype), v.astype(dtype)
