"""KVTC's transform coder: rows to bytes and back (arXiv 2511.01815, Sec. 3).

A row ``x`` (a token's keys of every layer and head, RoPE undone, or its values) is centred and
projected on the calibration basis, ``z = (x - mean) V``; each group of its plan
(:mod:`velox_kvtc.allocation`) is quantized (:mod:`velox_kvtc.quant`). The symbols of all rows
are laid out group by group in two sections, each entropy coded by DEFLATE (zlib, level 9; the
paper's coder, which it runs on the GPU through nvCOMP):

* **codes**: each component's codes over every row contiguous (component-major), two codes of
  at most 4 bits to a byte (low nibble first), wider codes and fp8 one to a byte; coded with
  Huffman codes only (zlib's ``Z_HUFFMAN_ONLY``: on such symbols, string matching costs more
  than it finds);
* **scales**: each integer group's float16 shifts, then its scales, split into byte planes
  (low bytes, then high bytes); coded with DEFLATE's default strategy.

Decoding inverts each step: ``x = z V^T + mean``, with dropped and never-stored components at 0.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from .allocation import Plan
from .quant import dequantize, quantize, symbol_bits

__all__ = ["Coded", "decode_rows", "encode_rows", "inflate", "project", "section_sizes"]


@dataclass(frozen=True)
class Coded:
    """One side's rows as stored: the DEFLATE streams of its two sections."""

    codes: bytes
    scales: bytes


def _code_bytes(size: int, dtype: str, rows: int) -> int:
    n = size * rows
    return (n + 1) // 2 if symbol_bits(dtype) <= 4 else n


def section_sizes(plan: Plan, rows: int) -> tuple[int, int]:
    """Bytes of ``rows`` rows' codes and scales before entropy coding."""
    codes = scales = 0
    for g in plan.groups:
        if g.dtype != "zero":
            codes += _code_bytes(g.size, g.dtype, rows)
            scales += 4 * rows if g.dtype.startswith("int") else 0
    return codes, scales


def project(rows: mx.array, mean: mx.array, basis: mx.array, components: int) -> mx.array:
    """``(rows - mean) @ basis[:, :components]`` in float32.

    Shapes: rows ``(N, F)``, mean ``(F,)``, basis ``(F, r)``; returns ``(N, components)``.
    """
    v = basis[:, :components].astype(mx.float32)
    return (rows.astype(mx.float32) - mean.astype(mx.float32)) @ v


def _nibbles(codes: mx.array) -> mx.array:
    flat = codes.reshape(-1)
    if flat.size % 2:
        flat = mx.concatenate([flat, mx.zeros((1,), mx.uint8)])
    pairs = flat.reshape(-1, 2)
    return pairs[:, 0] | (pairs[:, 1] << 4)


def _unnibble(packed: mx.array, n: int) -> mx.array:
    both = mx.stack([packed & 15, packed >> 4], axis=-1).reshape(-1)
    return both[:n]


def _planes(a: mx.array) -> mx.array:
    return a.view(mx.uint8).reshape(-1, 2).T.reshape(-1)


def _deflate(parts: list[mx.array], strategy: int) -> bytes:
    raw = np.array(mx.concatenate(parts)).tobytes() if parts else b""
    c = zlib.compressobj(9, zlib.DEFLATED, 15, 9, strategy)
    return c.compress(raw) + c.flush()


def encode_rows(rows: mx.array, mean: mx.array, basis: mx.array, plan: Plan) -> Coded:
    """``rows`` coded under ``plan``.

    Shapes: rows ``(N, F)``.
    """
    z = project(rows, mean, basis, plan.components)
    codes, scales, at = [], [], 0
    for g in plan.groups:
        if g.dtype != "zero":
            q, shift, scale = quantize(z[:, at : at + g.size], g.dtype)
            if shift is not None:
                scales += [_planes(shift), _planes(scale)]
            q = q.T  # component-major
            codes.append(_nibbles(q) if symbol_bits(g.dtype) <= 4 else q.reshape(-1))
        at += g.size
    return Coded(_deflate(codes, zlib.Z_HUFFMAN_ONLY), _deflate(scales, zlib.Z_DEFAULT_STRATEGY))


def inflate(data: bytes, size: int, what: str) -> mx.array:
    """The ``size`` bytes a DEFLATE stream ``data`` holds, as uint8.

    Raises:
        ValueError: a corrupt stream, one that holds another size, or trailing data.
    """
    d = zlib.decompressobj()
    try:
        out = d.decompress(data, size + 1)
    except zlib.error as e:
        raise ValueError(f"kvtc: the {what} stream is corrupt ({e})") from None
    if not d.eof or d.unused_data or len(out) != size:
        raise ValueError(
            f"kvtc: the {what} stream holds {len(out)}{'' if d.eof else '+'} bytes "
            f"({'complete' if d.eof else 'incomplete'}), the header needs {size}"
        )
    return mx.array(np.frombuffer(out, dtype=np.uint8)) if size else mx.zeros((0,), mx.uint8)


def decode_rows(coded: Coded, rows: int, mean: mx.array, basis: mx.array, plan: Plan) -> mx.array:
    """Inverse of :func:`encode_rows`.

    Shapes: returns float32 ``(rows, F)``.

    Raises:
        ValueError: streams that are corrupt or hold other sizes than ``plan`` needs.
    """
    n_codes, n_scales = section_sizes(plan, rows)
    codes = inflate(coded.codes, n_codes, "codes")
    scales = inflate(coded.scales, n_scales, "scales")
    cols, at, sat = [], 0, 0
    for g in plan.groups:
        if g.dtype == "zero":
            cols.append(mx.zeros((rows, g.size), mx.float32))
            continue
        shift = scale = None
        if g.dtype.startswith("int"):
            planes = scales[sat : sat + 4 * rows].reshape(2, 2, rows)  # (shift|scale, lo|hi, N)
            halves = planes.transpose(0, 2, 1).reshape(2, 2 * rows)
            shift, scale = (halves[j].view(mx.float16) for j in (0, 1))
            sat += 4 * rows
        n = _code_bytes(g.size, g.dtype, rows)
        q = codes[at : at + n]
        q = _unnibble(q, g.size * rows) if symbol_bits(g.dtype) <= 4 else q
        at += n
        cols.append(dequantize(q.reshape(g.size, rows).T, g.dtype, shift, scale))
    z = mx.concatenate(cols, axis=1) if cols else mx.zeros((rows, 0), mx.float32)
    v = basis[:, : plan.components].astype(mx.float32)
    return z @ v.T + mean.astype(mx.float32)
