"""``XKVGroup``: the coordinator of a group of adjacent layers, and the cross-layer SVD.

xKV (arXiv 2503.18893, Section 4) concatenates the KV-caches of ``G`` adjacent layers along
the feature axis, ``X = [X_1, ..., X_G]`` (``T x G*H*D``, per sequence), and keeps the rank-
``r`` part of its SVD, ``X ~ A [B_1, ..., B_G]``: ``A`` (``T x r``) is the token basis the
layers share, stored once for the group, ``B_l`` (``r x H*D``) each layer's reconstruction
matrix. Keys are factorized before RoPE, values as they are, each with its own rank.

The group owns ``A`` (for keys and values) and the fit; its layers' caches (one
:class:`~velox_xkv.cache.XKVCache` per layer, ``members`` in layer order) own their ``B_l``
and an fp16 window. Layers run in order within a forward, so a prefill chunk reaches layer
``l`` of the group before ``l + 1``: each layer stores the chunk in its window and marks itself
pending; the layer whose chunk completes the group (the group's last layer, in a model) runs
:meth:`fit`, which moves every layer's window into the latent. Until then the earlier layers
hold the chunk in fp16 (the transient: one chunk of the group's layers, in fp16).

A prefill that arrives in several chunks is factorized by an exact incremental update: with
``A`` orthonormal, ``[A B; X_new] = diag(A, I) [B; X_new]``, so the SVD of the small matrix
``C = [B; X_new]`` (``(r + n) x F``) gives the SVD of the stack; its rank-``r`` part is the
best rank-``r`` approximation of (the current factorization, the new tokens). A prefill that
arrives whole is the paper's one SVD. The SVD runs in float64 (NumPy) through the Gram matrix
of the smaller side of ``C``, per sequence of the batch.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import numpy as np

from velox_core import Packed
from velox_core.cache.linked import LayerGroup
from velox_core.cache.store import PackedStore

__all__ = ["XKVGroup", "truncated_svd"]


def _f64(x: mx.array) -> np.ndarray:
    """``x`` as a float64 numpy array (through float32: numpy reads no bfloat16 buffer)."""
    return np.array(x.astype(mx.float32), dtype=np.float64)


def truncated_svd(c: np.ndarray, rank: int) -> tuple[np.ndarray, np.ndarray]:
    """The rank-``rank`` SVD of each matrix of a stack, as ``(U, S V^T)``.

    Shapes:
        c ``(B, n, F)`` float64; returns ``U`` ``(B, n, r)`` (orthonormal columns) and
        ``S V^T`` ``(B, r, F)``, ``r = min(rank, n, F)``, singular values descending.
    """
    n, f = c.shape[1:]
    r = min(rank, n, f)
    if n <= f:  # eigenvectors of C C^T are U; S V^T = U^T C
        w, u = np.linalg.eigh(c @ np.swapaxes(c, 1, 2))
        u = np.ascontiguousarray(u[:, :, ::-1][:, :, :r])
        return u, np.swapaxes(u, 1, 2) @ c
    w, v = np.linalg.eigh(np.swapaxes(c, 1, 2) @ c)  # eigenvectors of C^T C are V
    w, v = w[:, ::-1][:, :r], np.ascontiguousarray(v[:, :, ::-1][:, :, :r])
    s = np.sqrt(np.maximum(w, 0.0))
    cv = c @ v  # (B, n, r) = U S
    tiny = s <= 1e-9 * np.maximum(s[:, :1], 1e-300)  # null directions: no column, no row
    u = np.where(tiny[:, None, :], 0.0, cv / np.where(tiny, 1.0, s)[:, None, :])
    svt = np.where(tiny[:, :, None], 0.0, s[:, :, None] * np.swapaxes(v, 1, 2))
    return u, svt


class XKVGroup(LayerGroup):
    """The layers of one group and their shared token latent.

    Args:
        members: the group's layer caches, in layer order (a slot may be None in a copy that
            holds only some layers).
    """

    title, noun, shared = "a cross-layer group", "group", "latent"

    def __init__(self, members: list[Any]):
        # the shared latent, keys and values: Packed {"a": (B, 1, T, r)}, sized exactly
        self.store = (PackedStore(1), PackedStore(1))
        self.dirty = False  # A's columns are no longer orthonormal (after a trim)
        super().__init__(members)

    @property
    def tokens(self) -> int:
        return self.store[0].tokens

    def named_stores(self) -> dict[str, PackedStore]:
        return {"lat.k": self.store[0], "lat.v": self.store[1]}

    def take_shared(self, other: XKVGroup) -> None:
        self.store, self.dirty = other.store, other.dirty

    def latent(self, kind: int, tokens: int, heads: int) -> Packed:
        """The first ``tokens`` of the key (0) or value (1) latent as a layer's record."""
        a = self.store[kind].view().data["a"][:, :, :tokens]
        b, _, t, r = a.shape
        return Packed({"a": mx.broadcast_to(a, (b, heads, t, r))}, t)

    def shrink(self) -> None:
        """Drop latent tokens no layer uses any more (after the layers' trims)."""
        keep = max(m._lat for m in self.present)
        if keep < self.tokens:
            for s in self.store:
                s.replace(s.view().slice(0, keep) if keep else None)
            self.dirty = keep > 0

    # -- the fit -----------------------------------------------------------------------------
    def ready(self) -> bool:
        """Every layer holds the same tokens, with a prefill chunk pending in its window."""
        ms = self.present
        first = ms[0]
        return all(
            m._pending and m._lat == first._lat == self.tokens and m.offset == first.offset
            for m in ms
        )

    def maybe_fit(self) -> bool:
        if not self.ready():
            return False
        self.fit()
        return True

    def fit(self) -> None:
        """Move every layer's window into the latent (joint incremental SVD, keys and values)."""
        ms = self.present
        if self.dirty:
            self._orthonormalize()
        lat = ms[0]._lat
        n = ms[0].stored.window[0].tokens
        dtype = ms[0].stored.dtype
        for kind in (0, 1):
            rank = ms[0].cfg.key_rank if kind == 0 else ms[0].cfg.value_rank
            xs, bs = [], []
            for m in ms:
                x = m.stored.window[kind].view().data["x"]  # (B, H, n, D)
                if kind == 0 and m.cfg.pre_rope:
                    x = m.unrotate(x, lat)
                xs.append(_f64(_tokens_by_feature(x)))
                codec = m._kc if kind == 0 else m._vc
                if lat:
                    bs.append(_f64(_rows_by_feature(codec.basis)))
            x = np.concatenate(xs, axis=2)  # (B, n, F)
            c = x if not lat else np.concatenate([np.concatenate(bs, axis=2), x], axis=1)
            u, svt = truncated_svd(c, rank)
            r_old = c.shape[1] - n
            a_new = u[:, r_old:]
            if lat:
                a_old = _f64(self.store[kind].view().data["a"][:, 0])
                a_new = np.concatenate([a_old @ u[:, :r_old], a_new], axis=1)
            self.store[kind].replace(Packed({"a": _mx(a_new[:, None]).astype(dtype)}, lat + n))
            start = 0
            for m in ms:
                h, d = m.stored.dims[1], m.stored.dims[2 + kind]  # (B, H, Dk, Dv)
                part = svt[:, :, start : start + h * d]  # (B, r, H*D)
                start += h * d
                basis = part.reshape(part.shape[0], part.shape[1], h, d).transpose(0, 2, 1, 3)
                (m._kc if kind == 0 else m._vc).basis = _mx(basis).astype(dtype)
        for m in ms:
            m.stored.window[0].replace(None)
            m.stored.window[1].replace(None)
            m._lat, m._pending = lat + n, False
            m.stored_changed()
        mx.eval([a for s in self.store for a in s.arrays()], [m._kc.basis for m in ms])

    def _orthonormalize(self) -> None:
        """``A = Q R``: keep ``Q`` as the latent and fold ``R`` into every layer's basis."""
        for kind in (0, 1):
            a = _f64(self.store[kind].view().data["a"][:, 0])
            q, r = np.linalg.qr(a)
            dtype = self.store[kind].view().data["a"].dtype
            self.store[kind].replace(Packed({"a": _mx(q[:, None]).astype(dtype)}, q.shape[1]))
            for m in self.present:
                codec = m._kc if kind == 0 else m._vc
                b = _f64(codec.basis)  # (B, H, r, D)
                codec.basis = _mx(np.einsum("bij,bhjd->bhid", r, b)).astype(dtype)
        self.dirty = False


def _tokens_by_feature(x: mx.array) -> mx.array:
    """``(B, H, T, D)`` to ``(B, T, H*D)`` float32 (a layer's rows of the stacked matrix)."""
    b, h, t, d = x.shape
    return mx.transpose(x.astype(mx.float32), (0, 2, 1, 3)).reshape(b, t, h * d)


def _rows_by_feature(basis: mx.array) -> mx.array:
    """A basis ``(B, H, r, D)`` as ``(B, r, H*D)`` float32, the layout of ``S V^T``."""
    b, h, r, d = basis.shape
    return mx.transpose(basis.astype(mx.float32), (0, 2, 1, 3)).reshape(b, r, h * d)


def _mx(x: np.ndarray) -> mx.array:
    """A float32 MLX array of a float64 NumPy result."""
    return mx.array(np.ascontiguousarray(x, dtype=np.float32))
