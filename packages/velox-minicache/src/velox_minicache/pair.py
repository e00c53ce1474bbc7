"""``MergedPair``: the coordinator of two adjacent layers whose caches share merged tokens.

The pair owns what its two layers share: the merged direction of every merged token, keys
and values (``e`` ``(B, H, T, D)`` in the storage dtype, stored once), the positions of the
retained tokens (``(N, 2)`` int32 rows ``(b * H + h, t)``, the same for both layers) and the
running range of angular distances per sequence (``(B,)`` float32, for the retention
threshold). Each layer's cache (:class:`~velox_minicache.cache.MiniCache`, ``members`` in
layer order) owns its magnitudes ``(B, H, T)``, its retained vectors ``(N, D)`` and an fp16
window of the tokens not merged yet.

Order: layers run in order within a forward, so new tokens reach layer ``l-1`` before layer
``l``. Each layer stores them in its window and attends to them as given (as the paper's
prefill and decode steps attend before merging); the tokens both windows hold are merged at
the pair's next update (the next prefill chunk or decode step), before the new tokens are
stored. So a decode step's token is merged one step later, and the last step's tokens stay
in fp16 until another update comes.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import numpy as np

from velox_core import Packed
from velox_core.cache.linked import LayerGroup
from velox_core.cache.store import PackedStore

from .merge import distance_range, retained, slerp_merge

__all__ = ["MergedPair"]


class MergedPair(LayerGroup):
    """Two adjacent layers' shared merged tokens.

    Args:
        members: the layers' caches, in layer order (a slot may be None: a copy holding one
            layer alone).
    """

    title, noun, shared = "a merged pair", "pair", "merged tokens"

    def __init__(self, members: list[Any]):
        self.dirs = (PackedStore(256), PackedStore(256))  # Packed {"e": (B, H, T, D)}
        self.pos: list[mx.array | None] = [None, None]  # keys, values: (N, 2) int32
        self.lo: list[mx.array | None] = [None, None]  # (B,) smallest distance so far
        self.hi: list[mx.array | None] = [None, None]  # (B,) largest distance so far
        super().__init__(members)

    @property
    def tokens(self) -> int:
        return self.dirs[0].tokens

    def shared_arrays(self) -> dict[str, mx.array]:
        """The pair's arrays besides the directions: positions and distance ranges."""
        out = {}
        for i, kind in enumerate("kv"):
            for name, a in (("pos", self.pos[i]), ("lo", self.lo[i]), ("hi", self.hi[i])):
                if a is not None:
                    out[f"{name}.{kind}"] = a
        return out

    def set_shared(self, arrays: dict[str, mx.array]) -> None:
        for i, kind in enumerate("kv"):
            self.pos[i] = arrays.get(f"pos.{kind}")
            self.lo[i] = arrays.get(f"lo.{kind}")
            self.hi[i] = arrays.get(f"hi.{kind}")

    def named_stores(self) -> dict[str, PackedStore]:
        return {"dir.k": self.dirs[0], "dir.v": self.dirs[1]}

    def take_shared(self, other: MergedPair) -> None:
        self.dirs = other.dirs
        self.set_shared(other.shared_arrays())

    # -- merging ----------------------------------------------------------------------------
    def ready(self) -> int:
        """Tokens both layers hold unmerged at the same positions (0 unless both layers are
        present, have stored tokens and use every merged token)."""
        if len(self.present) != 2:
            return 0
        a, b = self.members
        if a.stored.dims is None or b.stored.dims is None:
            return 0
        if a._merged != self.tokens or b._merged != self.tokens:
            return 0  # a trim left the layers at different lengths; wait for the other
        return min(a.stored.window[0].tokens, b.stored.window[0].tokens)

    def merge_pending(self) -> None:
        """Merge the tokens both layers' windows hold (oldest first) into the pair."""
        n = self.ready()
        if n == 0:
            return
        a, b = self.members
        if a.stored.dims != b.stored.dims or a.stored.dtype != b.stored.dtype:
            raise ValueError(
                f"minicache: layers {a.layer} and {b.layer} hold KV of shapes {a.stored.dims} / "
                f"{b.stored.dims} ({a.stored.dtype} / {b.stored.dtype}); a merged pair needs "
                "equal shapes"
            )
        bsz, h, _, _ = a.stored.dims
        start, dtype, cfg = self.tokens, a.stored.dtype, a.cfg
        for kind in (0, 1):
            x1 = a.stored.window[kind].view().slice(0, n).data["x"]  # (B, H, n, D) layer l-1
            x2 = b.stored.window[kind].view().slice(0, n).data["x"]  # layer l
            e, n1, n2, d = slerp_merge(x1, x2, cfg.t)
            lo, hi = distance_range(d, self.lo[kind], self.hi[kind])
            keep = np.array(retained(d, lo, hi, cfg.gamma)).reshape(bsz * h, n)
            self.dirs[kind].append(Packed({"e": e.astype(dtype)}, n))
            a._mag[kind].append(Packed({"m": n1.astype(dtype)}, n))
            b._mag[kind].append(Packed({"m": n2.astype(dtype)}, n))
            self.lo[kind], self.hi[kind] = lo, hi
            rows, cols = np.nonzero(keep)
            if rows.size:
                bh = mx.array(rows.astype(np.int32))
                tl = mx.array(cols.astype(np.int32))
                pos = mx.stack([bh, tl + start], axis=1)
                self.pos[kind] = _cat(self.pos[kind], pos)
                for m, x in ((a, x1), (b, x2)):
                    d_ = x.shape[-1]
                    m._ret[kind] = _cat(m._ret[kind], x.reshape(bsz * h, n, d_)[bh, tl])
        for m in (a, b):
            m.stored.window[0].drop_front(n)
            m.stored.window[1].drop_front(n)
            m._merged = start + n
            m.stored_changed()
        mx.eval(
            [x for s in self.dirs for x in s.arrays()],
            [x for m in (a, b) for s in (*m._mag, *m.stored.window) for x in s.arrays()],
            [x for x in (*self.pos, *self.lo, *self.hi, *a._ret, *b._ret) if x is not None],
        )

    def shrink(self) -> None:
        """Drop merged tokens no layer uses any more (after the layers' trims)."""
        keep = max(m._merged for m in self.present)
        if keep >= self.tokens:
            return
        for s in self.dirs:
            s.truncate(keep)
        for kind in (0, 1):
            if self.pos[kind] is None:
                continue
            sel = np.nonzero(np.array(self.pos[kind][:, 1]) < keep)[0]
            if sel.size == self.pos[kind].shape[0]:
                continue
            idx = mx.array(sel.astype(np.int32))
            self.pos[kind] = self.pos[kind][idx] if sel.size else None
            for m in self.present:
                m._ret[kind] = m._ret[kind][idx] if sel.size else None


def _cat(a: mx.array | None, b: mx.array) -> mx.array:
    return b if a is None else mx.concatenate([a, b], axis=0)
