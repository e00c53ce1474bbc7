"""Bit packing of 1 to 8 bit codes into uint32 words, as one dense little-endian bit stream.

Code ``i`` of a row occupies bits ``[i*b, (i+1)*b)`` of the row's stream; word ``w`` holds
stream bits ``[32w, 32w+32)`` (least significant first). Widths that do not divide 32
(3, 5, 6, 7) straddle word boundaries, so no bit is wasted: ``n`` codes take
``ceil(n*b/32)`` words. For 2, 3, 4, 5, 6 and 8 bits the layout equals MLX's own
(``mx.quantize``), so ``mx.quantized_matmul`` can read these words directly.
"""

from __future__ import annotations

from functools import lru_cache

import mlx.core as mx
import numpy as np

from ..validation import check_array, check_bits, check_int

__all__ = ["MLX_GROUPS"]

# widths whose codes never straddle a byte: :func:`lookup` reads them a byte at a time
BYTE_BITS = (1, 2, 4, 8)

# widths and groups whose codes are laid out as MLX's affine quantization lays them out
MLX_BITS = (2, 3, 4, 5, 6, 8)
MLX_GROUPS = (32, 64, 128)


def mlx_layout(bits: int, group: int) -> bool:
    """Whether per-token codes of this width and group are laid out as MLX's affine
    quantization lays them out (2-6 or 8 bits, groups of 32, 64 or 128): ``mx.dequantize``
    and ``mx.quantized_matmul`` read their words, scales and zeros (MLX's biases)."""
    return bits in MLX_BITS and group in MLX_GROUPS


def mlx_readable(bits: int, group: int) -> bool:
    """Whether ``mx.quantized_matmul`` should read per-token codes of this width and group
    here: MLX's own layout (:func:`mlx_layout`), and not on MLX's CUDA backend, whose
    ``quantized_matmul`` (MLX 0.32.4) lacks shapes a cache meets (seen on an H200: "No
    implementation for problem shape: 4x4965x128x16": codes that are not contiguous, as the
    rows of a cache's buffers of several batch rows or heads are not); there callers take
    their decoded path, and decode steps the fused kernels."""
    from ..kernels import backend

    return mlx_layout(bits, group) and backend() != "cuda"


def packed_words(n: int, bits: int) -> int:
    """Number of uint32 words that hold ``n`` codes of ``bits`` bits."""
    return (n * bits + 31) // 32


@lru_cache(maxsize=256)
def _plan(n: int, bits: int):
    """Static gather plans: which code feeds which word, and with what shift."""
    words = packed_words(n, bits)
    start = np.arange(n) * bits
    word, shift = start // 32, start % 32
    straddle = shift + bits > 32
    # packing: word w = sum of (code << shift) for codes starting in w, plus
    # (code >> (32 - shift)) for codes that started in w-1 and straddle into w
    per_word = max(int(np.bincount(word, minlength=words).max()), 1)
    lo_idx = np.full((words, per_word), n, dtype=np.int32)  # n = index of a zero pad code
    lo_sh = np.zeros((words, per_word), dtype=np.uint32)
    fill = np.zeros(words, dtype=np.int64)
    for i in range(n):
        w = word[i]
        lo_idx[w, fill[w]] = i
        lo_sh[w, fill[w]] = shift[i]
        fill[w] += 1
    hi_idx = np.full((words,), n, dtype=np.int32)
    hi_sh = np.zeros((words,), dtype=np.uint32)
    for i in np.nonzero(straddle)[0]:
        hi_idx[word[i] + 1] = i
        hi_sh[word[i] + 1] = 32 - shift[i]
    return (
        mx.array(lo_idx),
        mx.array(lo_sh),
        mx.array(hi_idx),
        mx.array(hi_sh),
        mx.array(word.astype(np.int32)),
        mx.array(shift.astype(np.uint32)),
        mx.array(np.minimum(word + 1, words - 1).astype(np.int32)),
        mx.array(np.where(straddle, 32 - shift, 0).astype(np.uint32)),
        mx.array(straddle),
    )


def pack(codes: mx.array, bits: int) -> mx.array:
    """Pack integer codes along the last axis.

    Shapes:
        codes: ``(..., n)`` integer codes in ``[0, 2**bits)``; returns ``(..., ceil(n*bits/32))``
        uint32.
    """
    check_bits("bits", bits)
    check_array("codes", codes, min_ndim=1)
    n = codes.shape[-1]
    check_int("codes.shape[-1]", n, minimum=1)
    lo_idx, lo_sh, hi_idx, hi_sh, *_ = _plan(n, bits)
    c = codes.astype(mx.uint32) & ((1 << bits) - 1)
    c = mx.concatenate([c, mx.zeros((*c.shape[:-1], 1), dtype=mx.uint32)], axis=-1)
    lo = mx.take(c, lo_idx.reshape(-1), axis=-1).reshape(*c.shape[:-1], *lo_idx.shape)
    words = mx.sum(mx.left_shift(lo, lo_sh), axis=-1)
    if bits not in (1, 2, 4, 8):
        hi = mx.take(c, hi_idx, axis=-1)
        words = words + mx.right_shift(hi, hi_sh)  # pad code 0 where nothing straddles
    return words.astype(mx.uint32)


def unpack(words: mx.array, bits: int, n: int) -> mx.array:
    """Inverse of :func:`pack`.

    Shapes:
        words: ``(..., ceil(n*bits/32))`` uint32; returns ``(..., n)`` uint8 codes.
    """
    check_bits("bits", bits)
    check_array("words", words, min_ndim=1, dtypes=(mx.uint32,))
    check_int("n", n, minimum=1)
    if words.shape[-1] != packed_words(n, bits):
        raise ValueError(
            f"unpack: {n} codes of {bits} bits need {packed_words(n, bits)} words, "
            f"got {words.shape[-1]}"
        )
    *_, word, shift, word2, shift2, straddle = _plan(n, bits)
    mask = (1 << bits) - 1
    out = mx.right_shift(mx.take(words, word, axis=-1), shift)
    if bits not in (1, 2, 4, 8):
        hi = mx.left_shift(mx.take(words, word2, axis=-1), shift2)
        out = mx.where(straddle, out | hi, out)
    return (out & mask).astype(mx.uint8)


def byte_table(values: mx.array, bits: int) -> mx.array:
    """``(256, 8 / bits)``: for each byte value, ``values[code]`` of the codes it holds, lowest
    bits first (the table :func:`lookup` reads).

    Shapes: values ``(2**bits,)``; returns ``(256, 8 // bits)`` in ``values.dtype``.
    """
    if bits not in BYTE_BITS:
        raise ValueError(f"byte_table: bits must be one of {BYTE_BITS}, got {bits}")
    if tuple(values.shape) != (1 << bits,):
        raise ValueError(f"byte_table: values must be ({1 << bits},), got {tuple(values.shape)}")
    shifts = mx.arange(0, 8, bits, dtype=mx.uint32)
    codes = (mx.arange(256, dtype=mx.uint32)[:, None] >> shifts) & ((1 << bits) - 1)
    return mx.take(values, codes.astype(mx.int32))


def lookup(words: mx.array, bits: int, n: int, table: mx.array) -> mx.array:
    """``values[code]`` of the ``n`` codes packed in each row of ``words``, in one gather: each
    byte of the words (little-endian) indexes its row of ``table`` (:func:`byte_table`), with
    no unpacked copy of the codes.

    Shapes: words ``(..., ceil(n*bits/32))`` uint32; returns ``(..., n)`` in ``table.dtype``.
    """
    if bits not in BYTE_BITS or tuple(table.shape) != (256, 8 // bits):
        raise ValueError(
            f"lookup: bits must be one of {BYTE_BITS} with a (256, 8 / bits) table, got {bits} "
            f"and {tuple(table.shape)}"
        )
    if words.dtype != mx.uint32 or words.shape[-1] != packed_words(n, bits):
        raise ValueError(
            f"lookup: {n} codes of {bits} bits need {packed_words(n, bits)} uint32 words, got "
            f"{tuple(words.shape)} {words.dtype}"
        )
    by = mx.view(words, mx.uint8)  # (..., 4 * words)
    out = mx.take(table, by, axis=0).reshape(*by.shape[:-1], -1)  # (..., 32 * words / bits)
    return out if out.shape[-1] == n else out[..., :n]
