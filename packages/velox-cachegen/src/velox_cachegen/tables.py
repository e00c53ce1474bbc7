"""CacheGen's probability models: frequency tables counted per layer and channel, stored.

The paper (arXiv 2310.07240, Sec. 5.1) finds that grouping a KV cache's symbols by layer and
channel gives the arithmetic coder its most informative distributions, and keeps one per
channel and layer. velox counts, for each chunk and layer-side, one table per channel for the
delta (or plain) symbols and one per delta channel for the anchors; where a chunk is short, a
table per channel costs more than it saves, and the encoder *pools* a layer-side's channels
into one table (whichever of the two takes fewer bytes, tables included).

A table is stored as its first symbol, its span and its raw counts; the coder's frequencies
are derived from the counts by :func:`velox_cachegen.rangecoder.normalize` on both sides. A
chunk's tables are one DEFLATE-compressed blob of LEB128 varints: every table's first symbol
(zigzag), every span, then every count (:func:`pack` / :func:`unpack`).
"""

from __future__ import annotations

import itertools
import zlib

import numpy as np

from .rangecoder import PRECISION

__all__ = ["count", "pack", "unpack", "unvarints", "varints"]

MAX_SPAN = 1 << PRECISION  # a table's symbols: at most one frequency unit each


def varints(v: np.ndarray) -> bytes:
    """LEB128 bytes of non-negative integers (< 2**63)."""
    v = np.asarray(v, dtype=np.uint64).ravel()
    if v.size == 0:
        return b""
    nb = np.ones(v.size, dtype=np.int64)
    for k in range(1, 10):
        nb += v >= np.uint64(1) << np.uint64(7 * k)
    ends = np.cumsum(nb)
    out = np.zeros(int(ends[-1]), dtype=np.uint8)
    starts = ends - nb
    for k in range(int(nb.max())):
        has = nb > k
        byte = (v[has] >> np.uint64(7 * k)) & np.uint64(0x7F)
        more = (nb[has] > k + 1).astype(np.uint64) << np.uint64(7)
        out[starts[has] + k] = (byte | more).astype(np.uint8)
    return out.tobytes()


def unvarints(data: bytes, n: int, at: int = 0) -> tuple[np.ndarray, int]:
    """The first ``n`` LEB128 integers of ``data`` from byte ``at`` and the position after them.

    Raises:
        ValueError: fewer than ``n`` complete integers, or one wider than 63 bits.
    """
    b = np.frombuffer(data, dtype=np.uint8)[at:]
    if n == 0:
        return np.zeros(0, dtype=np.int64), at
    last = np.flatnonzero(b < 0x80)
    if last.size < n:
        raise ValueError(f"{n} varints expected, {last.size} found")
    last = last[:n]
    first = np.concatenate([[0], last[:-1] + 1])
    width = last - first + 1
    if width.max() > 9:
        raise ValueError("a varint wider than 63 bits")
    out = np.zeros(n, dtype=np.uint64)
    for k in range(int(width.max())):
        has = width > k
        out[has] |= (b[first[has] + k] & np.uint64(0x7F)).astype(np.uint64) << np.uint64(7 * k)
    return out.astype(np.int64), at + int(last[-1]) + 1


def _zigzag(v: np.ndarray) -> np.ndarray:
    v = np.asarray(v, dtype=np.int64)
    return np.where(v >= 0, 2 * v, -2 * v - 1)


def _unzigzag(v: np.ndarray) -> np.ndarray:
    return np.where(v % 2 == 0, v // 2, -(v + 1) // 2)


def count(symbols: np.ndarray, columns: bool) -> tuple[np.ndarray, list[np.ndarray]]:
    """Tables of ``(N, C)`` symbols: one per column (``columns``) or one for all.

    Returns:
        ``(lo, counts)``: each table's first symbol and its counts over ``lo .. lo + span``.

    Raises:
        ValueError: a table would span more than ``2 ** PRECISION`` symbols.
    """
    if not columns:
        symbols = symbols.reshape(-1, 1)
    lo = symbols.min(axis=0).astype(np.int64)
    spans = symbols.max(axis=0).astype(np.int64) - lo + 1
    if spans.max() > MAX_SPAN:
        raise ValueError(
            f"a table spans {int(spans.max())} symbols (at most {MAX_SPAN}): the step is too "
            "fine for these values"
        )
    c = symbols.shape[1]
    width = int(spans.max())
    flat = (symbols - lo) + np.arange(c, dtype=np.int64) * width
    counts = np.bincount(flat.ravel(), minlength=c * width).reshape(c, width)
    return lo, [counts[i, : spans[i]] for i in range(c)]


def pack(lo: np.ndarray, counts: list[np.ndarray]) -> bytes:
    """A chunk's tables as one DEFLATE blob (module docstring)."""
    spans = np.array([len(x) for x in counts], dtype=np.int64)
    flat = np.concatenate(counts) if counts else np.zeros(0, np.int64)
    raw = varints(_zigzag(lo)) + varints(spans) + varints(flat)
    return zlib.compress(raw, 9)


def unpack(blob: bytes, tables: int) -> tuple[np.ndarray, list[np.ndarray]]:
    """Inverse of :func:`pack` for ``tables`` tables.

    Raises:
        ValueError: a blob that does not hold exactly that many well-formed tables.
    """
    try:
        raw = zlib.decompress(blob)
    except zlib.error as e:
        raise ValueError(f"the frequency tables are not DEFLATE data ({e})") from None
    lo, at = unvarints(raw, tables)
    spans, at = unvarints(raw, tables, at)
    if tables and (spans.min() < 1 or spans.max() > MAX_SPAN):
        raise ValueError("a frequency table has an empty or oversized span")
    flat, at = unvarints(raw, int(spans.sum()), at)
    if at != len(raw):
        raise ValueError(f"{len(raw) - at} bytes after the frequency tables")
    bounds = np.concatenate([[0], np.cumsum(spans)])
    counts = [flat[a:b] for a, b in itertools.pairwise(bounds)]
    if any(x.sum() == 0 for x in counts):
        raise ValueError("a frequency table has no counts")
    return _unzigzag(lo), counts
