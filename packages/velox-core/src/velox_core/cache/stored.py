"""``Stored``: the tokens one :class:`~velox_core.cache.VeloxCache` holds, segment by segment.

A cache keeps its tokens in temporal order::

    sink | coded[n-1] ... coded[0] | window

Each segment is a ``(keys, values)`` pair of :class:`~velox_core.cache.store.PackedStore`:
``sink`` the first tokens kept as given, ``coded[i]`` tier ``i``'s codes (tier 0 the newest,
coded by ``cache.tiers[i]``'s codecs), ``window`` the newest tokens kept as given. With a
retention policy the coded body's absolute positions lie beside it (``positions``, int32
``(B, H, T, 1)``), and once per-head budgets differ the body is one ``(keys, values,
positions)`` store triple per KV head (``heads``; ``coded[0]`` and ``positions`` are then
empty). ``dims`` is ``(batch, kv_heads, key_dim, value_dim)`` and ``dtype`` the dtype tokens
are stored in, both None until the first tokens arrive.

The public view of a cache's storage: the decode attention (``PlannedAttention``), batching
(``VeloxBatch``) and linked layers' coordinators read ``cache.stored``; the cache writes it.
"""

from __future__ import annotations

import mlx.core as mx

from .store import PackedStore

__all__ = ["Stored"]

WINDOW_STEP = 16  # the window's growth quantum, in tokens


class Stored:
    """A cache's stores by segment (see the module).

    Args:
        tiers: coded tiers (one ``coded`` store pair each).
        step: growth quantum of the coded stores, in tokens.
    """

    __slots__ = ("coded", "dims", "dtype", "heads", "positions", "sink", "window")

    def __init__(self, tiers: int, step: int):
        # sinks are sized exactly (no slack); the window grows by WINDOW_STEP tokens, so most
        # decode steps write their token in place, and shrinks to what it keeps at a flush;
        # coded tiers grow by ``step``
        self.sink = (PackedStore(1), PackedStore(1))
        self.coded = [(PackedStore(step), PackedStore(step)) for _ in range(tiers)]
        self.window = (PackedStore(WINDOW_STEP), PackedStore(WINDOW_STEP))
        self.positions: PackedStore | None = None
        self.heads: list[list[PackedStore]] | None = None
        self.dims: tuple[int, int, int, int] | None = None  # (B, H, Dk, Dv)
        self.dtype: mx.Dtype | None = None

    @property
    def batch(self) -> int | None:
        """Batch rows held (None before the first tokens)."""
        return None if self.dims is None else self.dims[0]

    @property
    def n_sink(self) -> int:
        """Tokens held as sinks."""
        return self.sink[0].tokens

    @property
    def n_window(self) -> int:
        """Tokens held in the window."""
        return self.window[0].tokens

    def body(self) -> tuple:
        """The coded body's ``(keys, values, positions)`` records (one record for every head;
        None where empty), as a retention policy's cache cuts them."""
        k, v = self.coded[0]
        return k.view(), v.view(), None if self.positions is None else self.positions.view()

    def named(self) -> dict[str, PackedStore]:
        """Every store by its name in the cache's state record."""
        out = {
            "sink.k": self.sink[0],
            "sink.v": self.sink[1],
            "win.k": self.window[0],
            "win.v": self.window[1],
        }
        for i, (k, v) in enumerate(self.coded):
            out[f"tier{i}.k"], out[f"tier{i}.v"] = k, v
        if self.positions is not None:
            out["pos"] = self.positions
        for i, (k, v, p) in enumerate(self.heads or []):
            out[f"head{i}.k"], out[f"head{i}.v"], out[f"head{i}.pos"] = k, v, p
        return out
