"""``PackedStore``: a growable buffer of packed tokens with capacity counted honestly."""

from __future__ import annotations

import functools

import mlx.core as mx

from ..codec.base import Packed

__all__ = ["PackedStore"]


class PackedStore:
    """Packed tokens in preallocated buffers with headroom for the next appends.

    Appends write into the slack in place (no copy of what is already stored), like mlx-lm's
    ``KVCache``. ``nbytes`` counts the buffers (slack included), ``logical_nbytes`` only the
    rows in use.

    Args:
        step: the largest growth quantum, in tokens (the quantum is an eighth of the size, at
            least 16; ``step=1`` sizes the store exactly).
    """

    def __init__(self, step: int = 256):
        self.step = step
        self.buf: Packed | None = None
        self.tokens = 0

    @property
    def capacity(self) -> int:
        return 0 if self.buf is None else self.buf.tokens

    def _grow(self, like: Packed, need: int) -> None:
        # round up to a power-of-two quantum near an eighth of what is needed (at least 16, at
        # most `step` tokens), so small or just-evicted stores do not double on their next append
        q = 1 << max(4, (max(need // 8, 1)).bit_length() - 1)
        quantum = -(-min(self.step, q) // like.block) * like.block
        cap = -(-need // quantum) * quantum

        def alloc(name: str, a: mx.array) -> mx.array:
            rows = like.rows(name, cap)
            return mx.zeros((a.shape[0], a.shape[1], rows, *a.shape[3:]), dtype=a.dtype)

        fresh = like.map(alloc, tokens=cap)
        if self.buf is not None and self.tokens:
            used = self.view()
            fresh = fresh.map(lambda k, a: _write(a, used.data[k], 0))
        self.buf = fresh

    def reserve(self, need: int, like: Packed | None = None) -> None:
        """Grow (as an append would) until ``need`` tokens fit; an empty store takes the
        layout of ``like`` (a record of the tokens it will hold)."""
        like = self.buf if self.buf is not None else like
        if like is None:
            raise ValueError("PackedStore.reserve: an empty store needs a record to copy")
        if need > self.capacity:
            self._grow(like, need)

    def append(self, packed: Packed) -> None:
        """Add tokens at the end (``tokens`` must stay a multiple of the block)."""
        if packed.tokens == 0:
            return
        if self.buf is not None and (
            packed.block != self.buf.block or set(packed.data) != set(self.buf.data)
        ):
            raise ValueError("PackedStore.append: record layout differs from the store's")
        if self.buf is None or self.tokens + packed.tokens > self.capacity:
            if self.step == 1:
                # sized exactly: what is stored and the new tokens in one concatenation (one
                # copy, instead of a zeroed buffer and two writes)
                old = self.view()
                if old is None:
                    self.buf = packed.map(lambda _, a: mx.contiguous(a))
                else:
                    self.buf = Packed.concat([old, packed])
                self.tokens += packed.tokens
                return
            self._grow(packed, self.tokens + packed.tokens)
        start = self.tokens
        self.buf = self.buf.map(lambda k, a: _write(a, packed.data[k], self.buf.rows(k, start)))
        self.tokens += packed.tokens

    def put(self, packed: Packed) -> None:
        """:meth:`append` for a decode step: the tokens written into the buffers' room in
        place, unchecked (the caller has reserved the room and knows the layout is the
        store's)."""
        buf, n = self.buf, self.tokens
        for name, a in packed.data.items():
            row = buf.rows(name, n)
            buf.data[name][:, :, row : row + a.shape[2]] = a
        self.tokens += packed.tokens

    def write(self, start: int, packed: Packed) -> None:
        """Overwrite tokens ``[start, start + packed.tokens)`` in place (per-token records;
        the tokens must be stored already)."""
        if packed.tokens == 0:
            return
        if self.buf is None or packed.block != 1 or self.buf.block != 1:
            raise ValueError("PackedStore.write: needs stored per-token records")
        if set(packed.data) != set(self.buf.data):
            raise ValueError("PackedStore.write: record layout differs from the store's")
        if not 0 <= start <= start + packed.tokens <= self.tokens:
            raise ValueError(
                f"PackedStore.write: tokens [{start}, {start + packed.tokens}) are not within "
                f"the {self.tokens} stored"
            )
        self.buf = self.buf.map(lambda k, a: _write(a, packed.data[k], start))

    def view(self) -> Packed | None:
        """The tokens in use (slices of the buffers, no copy)."""
        if self.buf is None or self.tokens == 0:
            return None
        if self.tokens == self.capacity:
            return self.buf
        return self.buf.slice(0, self.tokens)

    def replace(self, packed: Packed | None) -> None:
        """Hold exactly ``packed`` (compacting: capacity equals tokens until the next append)."""
        if packed is None or packed.tokens == 0:
            self.buf, self.tokens = None, 0
            return
        self.buf = packed.map(lambda _, a: mx.contiguous(a))
        self.tokens = packed.tokens

    def keep(self, index: mx.array, room: int | None = None, rows: dict | None = None) -> None:
        """Keep only the tokens at ``index`` (ascending; per-token records only).

        The kept tokens are gathered, in one gather per array, to the front of buffers of
        ``min(capacity, room)`` tokens: a decode step's cut keeps the buffers' size (the
        next appends write into the rows after the kept ones), a prefill chunk's cut makes
        them ``room`` tokens (the evicted tokens' bytes leave memory). The rows after the
        kept ones repeat the last kept token until appends overwrite them. A gather into the
        buffers it reads would be no cheaper in MLX: a write into an array that the same
        graph reads copies the array first.

        Args:
            index: int ``(n,)`` shared by every batch row and head, or ``(B, H, n)``.
            room: the tokens the buffers are to hold until the next cut (the kept ones and
                those stored before the next cut); None: the kept tokens exactly.
            rows: a dict shared by the stores cut by one index (keys, values, positions):
                the flattened row indices, made once for buffers of the same shape.
        """
        buf = self.buf  # gathered from the buffers themselves: no view of the tokens in use
        if buf is None or self.tokens == 0:
            return
        n = index.shape[-1]
        if n == 0:
            self.replace(None)
            return
        if buf.per_block:
            raise ValueError("PackedStore.keep: tokens of a block-coded record cannot be gathered")
        cap = buf.tokens
        size = min(cap, n if room is None else max(room, n))  # the buffers' tokens after
        b, h = next(iter(buf.data.values())).shape[:2]
        rows = {} if rows is None else rows
        if (b, h, cap, size) not in rows:
            idx = index.astype(mx.int32)
            if idx.ndim == 1:
                idx = mx.broadcast_to(idx, (b, h, n))
            if size > n:  # the slack rows: the last kept token again
                idx = mx.concatenate([idx, mx.broadcast_to(idx[..., -1:], (b, h, size - n))], 2)
            # each row's source in the buffers, flattened over (batch, head, token)
            rows[b, h, cap, size] = (idx + _row_starts(b, h, cap)).reshape(-1)
        flat = rows[b, h, cap, size]

        def gather(_, a: mx.array) -> mx.array:
            got = mx.take(a.reshape(b * h * cap, -1), flat, axis=0)
            return got.reshape(b, h, size, *a.shape[3:])

        self.buf = self.buf.map(gather, tokens=size)
        self.tokens = n

    def drop_front(self, n: int) -> None:
        """Remove the oldest ``n`` tokens (copies what remains)."""
        if n <= 0:
            return
        self.replace(self.view().slice(n, self.tokens) if n < self.tokens else None)

    def truncate(self, n: int) -> None:
        """Keep the first ``n`` tokens (block-aligned); capacity is kept for reuse."""
        if n >= self.tokens:
            return
        if self.buf is not None and n % self.buf.block:
            raise ValueError(f"PackedStore.truncate: {n} is not a multiple of {self.buf.block}")
        self.tokens = n

    def map_batch(self, fn) -> None:
        """Apply ``fn`` to the batch axis of every buffer (filter, extract, extend)."""
        if self.buf is not None:
            self.buf = self.view().map(lambda _, a: fn(a))

    @property
    def nbytes(self) -> int:
        return 0 if self.buf is None else self.buf.nbytes

    @property
    def logical_nbytes(self) -> int:
        v = self.view()
        return 0 if v is None else v.nbytes

    def arrays(self) -> list[mx.array]:
        return [] if self.buf is None else self.buf.arrays()


@functools.lru_cache(maxsize=64)
def _row_starts(b: int, h: int, cap: int) -> mx.array:
    """The first flattened row of each (batch, head) in buffers of ``cap`` tokens: int32
    ``(b, h, 1)`` (a constant of the shape, made once)."""
    return (mx.arange(b * h, dtype=mx.int32) * cap).reshape(b, h, 1)


def _write(dst: mx.array, src: mx.array, row: int) -> mx.array:
    dst[:, :, row : row + src.shape[2]] = src
    return dst
