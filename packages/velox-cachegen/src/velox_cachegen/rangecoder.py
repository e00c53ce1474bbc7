"""A range coder over many independent streams at once, in numpy.

CacheGen (arXiv 2310.07240, Sec. 5) codes its quantized symbols with arithmetic coding under
probability tables counted per layer and channel. This module is that entropy coder: a range
coder (32-bit range, bytes out, carries resolved after the fact) whose state is a vector,
one entry per stream, so that every stream advances by one symbol per numpy step. Streams
are independent (each starts and ends on its own), which is what lets a decoder work on
them in parallel, as CacheGen's GPU decoder does with one CUDA thread per stream.

Frequency tables (:class:`Tables`) hold, per table, the first symbol ``lo``, and the
cumulative frequencies of the symbols ``lo .. lo + n - 1``, out of a total of
``2 ** PRECISION``. :func:`encode` takes, per step, each stream's table and symbol;
:func:`decode` takes the streams' bytes and each step's table and gives the symbols back.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

__all__ = ["PRECISION", "Tables", "decode", "encode", "normalize", "normalize_each"]

PRECISION = 15  # every table's frequencies sum to 2 ** PRECISION
_TOTAL = 1 << PRECISION
_TOP = 1 << 24  # renormalize (shift a byte out) while the range is below this
_MASK = (1 << 32) - 1
_FULL = (1 << 32) - 1
# the state fits int64: low < 2**33, range <= 2**32, cum * (range >> PRECISION) <= 2**32


def normalize(counts: np.ndarray) -> np.ndarray:
    """Frequencies summing to ``2 ** PRECISION`` from non-negative counts (one table per row):
    every symbol that occurs keeps a frequency of at least 1, one that does not gets 0.

    Deterministic (the decoder rebuilds the coder's tables from the stored counts with it).

    Shapes:
        counts ``(tables, n)`` integer with a positive sum per row; returns int64 of the
        same shape.
    """
    c = np.asarray(counts, dtype=np.int64)
    if c.ndim != 2 or c.shape[1] > _TOTAL or np.any(c < 0):
        raise ValueError("normalize: counts must be (tables, n) non-negative, n <= 2**15")
    tot = c.sum(axis=1, keepdims=True)
    if np.any(tot == 0):
        raise ValueError("normalize: a table has no counts")
    f = (c * _TOTAL) // tot
    f = np.where((c > 0) & (f == 0), 1, f)
    # the rounding error goes to (or comes from) each table's most frequent symbols
    rows = np.arange(c.shape[0])
    for _ in range(c.shape[1] + 1):
        diff = _TOTAL - f.sum(axis=1)
        if not np.any(diff):
            return f
        top = np.argmax(np.where(f > 1, f, -1) if np.any(diff < 0) else f, axis=1)
        room = f[rows, top] - 1
        step = np.where(diff > 0, diff, -np.minimum(-diff, room))
        f[rows, top] += step
    raise ValueError("normalize: counts cannot be scaled to the table total")


def normalize_each(counts: list[np.ndarray]) -> list[np.ndarray]:
    """:func:`normalize` of tables of different spans."""
    if not counts:
        return []
    width = max(len(c) for c in counts)
    pad = np.zeros((len(counts), width), dtype=np.int64)
    for i, c in enumerate(counts):
        pad[i, : len(c)] = c
    f = normalize(pad)
    return [f[i, : len(c)] for i, c in enumerate(counts)]


@dataclass(frozen=True)
class Tables:
    """Frequency tables for the coder. ``lo[t]`` is table ``t``'s first symbol and
    ``freq[offset[t] : offset[t + 1]]`` its frequencies (summing to ``2 ** PRECISION``)."""

    lo: np.ndarray  # (tables,) int64
    offset: np.ndarray  # (tables + 1,) int64
    freq: np.ndarray  # (entries,) int64

    @staticmethod
    def from_freqs(lo: np.ndarray, freqs: list[np.ndarray]) -> Tables:
        sizes = np.array([len(f) for f in freqs], dtype=np.int64)
        offset = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
        flat = np.concatenate(freqs).astype(np.int64) if freqs else np.zeros(0, np.int64)
        return Tables(np.asarray(lo, dtype=np.int64), offset, flat)

    def cum(self) -> np.ndarray:
        """Each entry's cumulative frequency (the start of its interval)."""
        c = np.cumsum(self.freq) - self.freq
        return c - np.repeat(c[self.offset[:-1]], np.diff(self.offset))


def encode(tables: Tables, steps: int, active: np.ndarray, fetch: Callable) -> list:
    """Code every stream's symbols into its own byte string.

    Args:
        tables: the frequency tables.
        steps: symbols in the longest stream.
        active: ``(steps,)`` int: how many streams (a prefix: streams are ordered longest
            first) code a symbol at each step.
        fetch: ``fetch(step, k)`` gives the first ``k`` streams' table ids and symbols at that
            step (two ``(k,)`` int arrays; each symbol with a nonzero frequency in its table).

    Returns:
        one ``bytes`` per stream (``len(active) and active[0]`` streams).

    Raises:
        ValueError: a symbol outside its table or of zero frequency.
    """
    n = int(active[0]) if steps else 0
    cum, freq = tables.cum(), tables.freq
    low = np.zeros(n, dtype=np.int64)
    rng = np.full(n, _FULL, dtype=np.int64)
    who, what = [], []  # emitted bytes: stream ids and 9-bit values (bit 8: a carry)
    for s in range(steps):
        k = int(active[s])
        if k == 0:
            continue
        t, sym = fetch(s, k)
        i = tables.offset[t] + (sym - tables.lo[t])
        if np.any(i < tables.offset[t]) or np.any(i >= tables.offset[t + 1]):
            raise ValueError("range coder: a symbol outside its table's range")
        f = freq[i]
        if not np.all(f):
            raise ValueError("range coder: a symbol of zero frequency in its table")
        lo_, rg = low[:k], rng[:k]
        r = rg >> PRECISION
        lo_ += cum[i] * r
        np.multiply(f, r, out=rg)
        while True:
            small = np.flatnonzero(rg < _TOP)
            if small.size == 0:
                break
            who.append(small)
            what.append(lo_[small] >> 24)
            lo_[small] = (lo_[small] << 8) & _MASK
            rg[small] <<= 8
    # flush: the value in [low, low + range) with the most trailing zero bits, top byte only
    who.append(np.arange(n))
    what.append((low + ((1 << 24) - 1)) >> 24)
    return _resolve(n, who, what)


def _resolve(n: int, who: list, what: list) -> list:
    """Per-stream bytes from the emitted 9-bit values: carries added into the bytes before
    them, trailing zero bytes dropped (the decoder reads zeros past a stream's end)."""
    ids = np.concatenate(who)
    vals = np.concatenate(what)
    order = np.argsort(ids, kind="stable")
    ids, vals = ids[order], vals[order]
    while np.any(vals > 255):
        carry = vals >> 8
        vals &= 255
        vals[:-1] += carry[1:]  # never across streams: a stream's first byte has no carry
    bounds = np.searchsorted(ids, np.arange(n + 1))
    data = vals.astype(np.uint8).tobytes()
    return [data[a:b].rstrip(b"\0") for a, b in itertools.pairwise(bounds)]


def decode(
    tables: Tables,
    steps: int,
    active: np.ndarray,
    table_ids: Callable,
    streams: list,
    store: Callable,
) -> None:
    """Inverse of :func:`encode`: ``store(step, k, symbols)`` receives each step's symbols of
    the first ``k`` streams, decoded with the tables ``table_ids(step, k)`` names (as
    :func:`encode`'s ``fetch`` gave them). ``streams``: the byte strings :func:`encode`
    returned (one altered or cut short decodes to other symbols: the container's checksums
    refuse such bytes before they get here)."""
    n = int(active[0]) if steps else 0
    if len(streams) != n:
        raise ValueError(f"range coder: {len(streams)} streams, the layout has {n}")
    cum, freq = tables.cum(), tables.freq
    # interval starts of every table, keyed by table: one sorted search serves every table
    rows = np.repeat(np.arange(tables.lo.size, dtype=np.int64), np.diff(tables.offset))
    key = (rows << (PRECISION + 1)) + cum
    lengths = np.array([len(b) for b in streams], dtype=np.int64)
    start = np.concatenate([[0], np.cumsum(lengths)])[:-1].astype(np.int64)
    buf = np.frombuffer(b"".join(streams) + b"\0", dtype=np.uint8).astype(np.int64)
    zero = buf.size - 1
    pos = np.zeros(n, dtype=np.int64)

    def take(sel: np.ndarray) -> np.ndarray:
        p = pos[sel]
        pos[sel] = p + 1
        return buf[np.where(p < lengths[sel], start[sel] + p, zero)]

    val = np.zeros(n, dtype=np.int64)
    everyone = np.arange(n)
    for _ in range(4):
        val = (val << 8) | take(everyone)
    rng = np.full(n, _FULL, dtype=np.int64)
    top = _TOTAL - 1
    for s in range(steps):
        k = int(active[s])
        if k == 0:
            continue
        t = table_ids(s, k)
        v, rg = val[:k], rng[:k]
        r = rg >> PRECISION
        q = np.minimum(v // r, top)
        f = np.searchsorted(key, (t << (PRECISION + 1)) + q, side="right") - 1
        store(s, k, tables.lo[t] + (f - tables.offset[t]))
        v -= cum[f] * r
        np.multiply(freq[f], r, out=rg)
        while True:
            small = np.flatnonzero(rg < _TOP)
            if small.size == 0:
                break
            v[small] = ((v[small] << 8) & _MASK) | take(small)
            rg[small] <<= 8
