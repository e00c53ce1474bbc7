"""Attention from a layer's share of its group's latent: the latent codecs.

A group's keys (or values) are factorized jointly as ``X_l ~ A @ B_l`` for every layer ``l``
of the group: ``A`` (``T x r``, orthonormal columns) is the token latent the group shares,
``B_l`` (``r x H*D``) the layer's reconstruction matrix. A layer's latent segment is a
``Packed`` record holding ``A`` as ``a`` ``(B, H, T, r)``: a broadcast view of the group's
``(B, 1, T, r)`` array, with the KV-head axis velox's attention reads (a view allocates
nothing; the cache counts the group's array once, see ``XKVCache.nbytes``). The codecs hold
the layer's ``B_l`` as ``basis`` ``(B, H, r, D)`` (its fitted state) and compute attention
without keeping any reconstruction:

* values fold: ``p @ (A @ B_l) = (p @ A) @ B_l`` (``M x r``, then ``r x D``);
* post-RoPE keys (``pre_rope=False``) score in the latent: ``q @ (A @ B_l)^T = (q @ B_l^T)
  @ A^T``, the query rotated into the basis once;
* pre-RoPE keys (the paper) cannot: a key's RoPE angle depends on its position, so
  ``q . R(t) (a_t B_l)`` has no form ``(q M) . a_t`` with one ``M`` for every ``t``. Keys are
  rebuilt per call from the latent (``A @ B_l``), turned by RoPE at their positions
  (``0 .. T-1``: the latent holds a prefix of the sequence) and scored; the rebuilt keys are
  transient, as in xKV's reconstruct-then-RoPE kernels.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx

from velox_core import Codec, Packed
from velox_core.ops.rope import RopeSpec, rotate
from velox_core.validation import check_bool

__all__ = ["LatentKeys", "LatentValues"]


class _Latent(Codec):
    """A layer's reconstruction matrix; records hold the group's latent."""

    def __init__(self):
        self.basis: mx.array | None = None  # (B, H, r, D), the storage dtype

    @staticmethod
    def latent(packed: Packed) -> mx.array:
        """The group's latent ``(B, 1, T, r)`` behind a record's broadcast view."""
        return packed.data["a"][:, :1]

    def rebuild(self, packed: Packed) -> mx.array:
        """``A @ B_l`` in float32 ``(B, H, T, D)`` (pre-RoPE keys, or values)."""
        a = self.latent(packed).astype(mx.float32)
        return a @ self.basis.astype(mx.float32)

    def encode(self, x: mx.array, positions: mx.array | None = None) -> Packed:
        raise TypeError(
            f"{self.name}: the latent is fitted by the layer group (XKVGroup.fit), jointly "
            "for every layer of the group, not encoded per layer"
        )

    def state(self) -> dict[str, mx.array]:
        return {} if self.basis is None else {"basis": self.basis}

    def set_state(self, state: dict[str, mx.array]) -> None:
        extra = sorted(set(state) - {"basis"})
        if extra:
            raise ValueError(f"{self.name}: unexpected state {extra}")
        self.basis = state.get("basis")

    def filter_batch(self, index: mx.array) -> None:
        if self.basis is not None:
            self.basis = self.basis[index]

    def extend_batch(self, other: _Latent) -> None:
        if (self.basis is None) != (other.basis is None):
            raise ValueError(f"{self.name}: cannot join a fitted layer with an unfitted one")
        if self.basis is not None:
            if self.basis.shape[1:] != other.basis.shape[1:]:
                raise ValueError(f"{self.name}: latent widths differ, cannot join the rows")
            self.basis = mx.concatenate([self.basis, other.basis], axis=0)


class LatentValues(_Latent):
    """A layer's values from the group's value latent."""

    name = "xkv-value"
    compressed_mix = True

    def config(self) -> dict[str, Any]:
        return {}

    def decode(self, packed: Packed) -> mx.array:
        return self.rebuild(packed)

    def mix(self, w: mx.array, packed: Packed) -> mx.array:
        """``(w @ A) @ B_l``: ``w`` ``(B, H, M, T)`` float32; returns ``(B, H, M, D)``."""
        a = self.latent(packed).astype(mx.float32)
        return (w @ a) @ self.basis.astype(mx.float32)


class LatentKeys(_Latent):
    """A layer's keys from the group's key latent (pre-RoPE, or post-RoPE).

    Args:
        pre_rope: the latent holds pre-RoPE keys; decoded keys are turned by ``rope``.
    """

    name = "xkv-key"

    def __init__(self, pre_rope: bool = True):
        super().__init__()
        self.pre_rope = check_bool("pre_rope", pre_rope)
        self.rope: RopeSpec | None = None

    @property
    def compressed_scores(self) -> bool:  # scores from the latent only without RoPE
        return not self.pre_rope

    def config(self) -> dict[str, Any]:
        return {"pre_rope": self.pre_rope}

    def decode(self, packed: Packed) -> mx.array:
        k = self.rebuild(packed)
        if not self.pre_rope:
            return k
        if self.rope is None:
            raise ValueError("xkv: pre-RoPE keys need the layer's RoPE (bind or rope_base)")
        return rotate(k, 0, self.rope)

    def scores(self, q: mx.array, packed: Packed) -> mx.array:
        """``q @ k^T``: ``q`` ``(B, H, M, D)`` float32, scale applied; returns ``(B, H, M, T)``."""
        if self.pre_rope:
            return q @ mx.swapaxes(self.decode(packed), -1, -2)
        a = self.latent(packed).astype(mx.float32)
        qb = q @ mx.swapaxes(self.basis.astype(mx.float32), -1, -2)  # (B, H, M, r)
        return qb @ mx.swapaxes(a, -1, -2)
