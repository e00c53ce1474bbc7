"""One level's codebook at work: nearest-level codes, and the ``cos, sin`` its codes stand for.

A :class:`LevelBook` holds the sorted levels of one polar level's codebook, either one row
shared by every sequence (the offline codebook of the angle law,
:func:`velox_polarquant.codebook.level_codebook`) or one row per batch row (the online
codebook fitted on a sequence's own angles, :func:`fit_levels`).

Codes are stored a level at a time as one little-endian bit stream of bytes. Widths of 1, 2,
4 or 8 bits never straddle a byte: each byte indexes a table of the ``cos, sin`` pairs of
the ``8 / b`` codes it holds, one gather a level. Other widths are unpacked first.
"""

from __future__ import annotations

from functools import cache

import mlx.core as mx
import numpy as np

from velox_core.ops import BYTE_BITS, kmeans, pack, packed_words, unpack

from .codebook import level_codebook

__all__ = ["FIT_SAMPLES", "LevelBook", "fit_levels", "law_book", "stored_bytes"]

FIT_SAMPLES = 1 << 16  # angles an online codebook is fitted on, at most (a seeded sample)


def stored_bytes(n: int, bits: int) -> int:
    """Bytes of ``n`` codes of ``bits`` bits as one bit stream."""
    return (n * bits + 7) // 8


def fit_levels(angles: mx.array, bits: int, seed: int) -> mx.array:
    """One codebook per batch row, by 1-D k-means++ and Lloyd steps on the row's angles
    (the paper's online codebook construction).

    A row with more than :data:`FIT_SAMPLES` angles is fitted on a seeded sample of that
    many; one with fewer angles than levels takes a level at each of its angles and repeats
    the last (a repeated level is never the nearest one: it costs nothing).

    Shapes:
        angles ``(B, ...)`` float32; returns float32 ``(B, 2^bits)``, each row ascending.
    """
    b = angles.shape[0]
    x = np.array(angles.astype(mx.float32)).reshape(b, -1)
    if x.shape[1] > FIT_SAMPLES:
        pick = np.random.default_rng(seed).choice(x.shape[1], FIT_SAMPLES, replace=False)
        x = x[:, np.sort(pick)]
    k = 1 << bits
    fit = min(k, x.shape[1])
    # a row at a time, each with the seed: a sequence's codebook is the same batched or alone
    c = np.stack([np.array(kmeans(mx.array(r[:, None]), fit, seed=seed)[0])[:, 0] for r in x])
    c = np.sort(c, axis=-1)
    if fit < k:
        c = np.concatenate([c, np.repeat(c[:, -1:], k - fit, axis=-1)], axis=-1)
    return mx.array(c.astype(np.float32))


class LevelBook:
    """The levels of one polar level's codebook, shared or per batch row.

    Args:
        levels: float32 ``(R, 2^bits)`` ascending: ``R = 1`` for one codebook shared by every
            row, else one row per batch row.
        bits: the code width.

    Shapes:
        :meth:`encode` takes angles ``(B, H, T, n)``; :meth:`cos_sin` stored bytes
        ``(B, H, T, stored_bytes(n, bits))``; ``B`` any when shared, else ``R``.
    """

    def __init__(self, levels: mx.array, bits: int):
        self.levels, self.bits = levels.astype(mx.float32), bits
        self.rows, k = levels.shape
        if k != 1 << bits:
            raise ValueError(f"LevelBook: {k} levels for {bits}-bit codes")
        self.bounds = ((self.levels[:, 1:] + self.levels[:, :-1]) / 2).reshape(-1)
        th = np.array(self.levels).astype(np.float64)
        pairs = np.stack([np.cos(th), np.sin(th)], axis=-1)  # (R, K, 2)
        self.code_table = mx.array(pairs.reshape(-1, 2).astype(np.float32))
        self.byte_table = None
        if bits in BYTE_BITS:  # each byte's 8 / b codes, lowest bits first
            per = 8 // bits
            codes = (np.arange(256)[:, None] >> (np.arange(per) * bits)) & ((1 << bits) - 1)
            table = pairs[:, codes].reshape(self.rows * 256, 2 * per)  # (R * 256, 2 per)
            self.byte_table = mx.array(table.astype(np.float32))

    def _offset(self, batch: int, per_row: int) -> mx.array | int:
        """The row offsets into a table of ``per_row`` entries a row (0 when shared)."""
        if self.rows == 1:
            return 0
        if batch != self.rows:
            raise ValueError(f"polarquant: codebooks fitted for {self.rows} rows, got {batch}")
        return (mx.arange(batch, dtype=mx.int32) * per_row).reshape(batch, 1, 1, 1)

    def encode(self, psi: mx.array) -> mx.array:
        """The stored bytes of the nearest level of each angle (Quant), by a binary search
        over the midpoints between levels.

        Shapes: psi float32 ``(B, H, T, n)``; returns uint8 ``(B, H, T, stored_bytes)``.
        """
        k = 1 << self.bits
        off = self._offset(psi.shape[0], k - 1)
        idx = mx.zeros(psi.shape, dtype=mx.int32)
        for step in reversed(range(self.bits)):
            cand = idx + (1 << step)
            idx = mx.where(psi >= mx.take(self.bounds, off + cand - 1), cand, idx)
        words = pack(idx.astype(mx.uint8), self.bits)
        return mx.view(words, mx.uint8)[..., : stored_bytes(psi.shape[-1], self.bits)]

    def cos_sin(self, a: mx.array, n: int) -> mx.array:
        """The ``cos, sin`` of the levels of ``n`` stored codes, interleaved (DeQuant's
        factors on the two halves of each code's block).

        Shapes: a uint8 ``(B, H, T, bytes)``; returns float32 ``(B, H, T, 2 n)``.
        """
        lead = a.shape[:-1]
        if self.byte_table is not None:
            idx = a if self.rows == 1 else a.astype(mx.int32) + self._offset(a.shape[0], 256)
            cs = mx.take(self.byte_table, idx, axis=0).reshape(*lead, -1)
            return cs if cs.shape[-1] == 2 * n else cs[..., : 2 * n]
        pad = 4 * packed_words(n, self.bits) - a.shape[-1]
        if pad:
            a = mx.concatenate([a, mx.zeros((*lead, pad), dtype=mx.uint8)], axis=-1)
        codes = unpack(mx.view(a, mx.uint32), self.bits, n).astype(mx.int32)
        codes = codes + self._offset(a.shape[0], 1 << self.bits)
        return mx.take(self.code_table, codes, axis=0).reshape(*lead, 2 * n)


@cache
def law_book(level: int, bits: int) -> LevelBook:
    """The offline codebook of a level's law as a shared :class:`LevelBook` (one a process)."""
    return LevelBook(mx.array(level_codebook(level, bits).centroids[None]), bits)
