"""What the decode kernels take from the code records (:mod:`velox_core.kernels.records`).

One record describes a segment's keys or values, one record class per code layout:
:class:`AffineCodes` (``x = scale * code + zero`` per token groups),
:class:`ChannelAffineCodes` (per-channel groups, KIVI's keys), :class:`CodebookCodes` (``x =
norm * levels[code]``), :class:`VQCodes` (a codeword per sub-vector), :class:`SketchCodes`
(QJL sign bits with :class:`SketchKeys`) and :class:`TableCodes` (CommVQ's RoPE-commutative
codes with :class:`TableKeys`, scored from per-call query tables), all :class:`CodeRecord`.
Here: the kernels' inputs built from a record (:func:`code_inputs`, :func:`sketch_inputs`),
the shape checks against the query's head dim (:func:`check_codes`) and the helpers of the
layouts (:func:`levels_symmetric`, :func:`sketch_matrix`, :func:`table_entries`).
"""

from __future__ import annotations

import struct

import mlx.core as mx
import numpy as np

from .records import (
    AFFINE,
    AFFINE_CHANNEL,
    CODEBOOK,
    SKETCH,
    TABLE,
    VQ,
    CodeRecord,
    SketchCodes,
    TableCodes,
    VQCodes,
)

__all__ = [
    "FP16_MAX",
    "LOG2E",
    "VQ_MAX_TABLE",
    "check_codes",
    "code_inputs",
    "float_bits",
    "levels_symmetric",
    "pad_rows",
    "qmul_bits",
    "sketch_inputs",
    "sketch_matrix",
    "table_entries",
    "unused_input",
]

# most floats of one side's VQ codebook (codewords x channels) the portable kernel keeps in
# threadgroup memory: 4 KiB a side beside the 16 KiB of scores (Metal allows 32 KiB)
VQ_MAX_TABLE = 1024

FP16_MAX = 2048  # most fp16 tokens (sinks + window) the fused merge takes

LOG2E = 1.4426950408889634


def qmul_bits(scale: float | None = None) -> int:
    """The ``QMUL`` template value: the float32 bits of ``log2(e)`` (times ``scale``, for
    queries that come unscaled), the factor the tensor-core kernel and the fp16 merge apply to
    the queries."""
    return float_bits(LOG2E * (1.0 if scale is None else float(scale)))


def float_bits(x: float) -> int:
    """The float32 bits of ``x`` as a signed int (a template value)."""
    return struct.unpack("<i", struct.pack("<f", float(x)))[0]


def levels_symmetric(levels) -> bool:
    """Whether codebook ``levels`` (host values: a numpy array or a list of floats) are
    ascending and symmetric about 0 in fp16, ``fp16(L[n - 1 - c]) == -fp16(L[c])`` for every
    code ``c``: what :attr:`CodebookCodes.symmetric` vouches for. One host check per codebook;
    never on a device array in a decode step (it would wait for the device)."""
    lev = np.asarray(levels, dtype=np.float32).reshape(-1)
    with np.errstate(over="ignore"):  # past fp16's range: infinite, refused below
        half = lev.astype(np.float16)
    if lev.size < 2 or not np.all(np.isfinite(half)) or np.any(np.diff(half) < 0):
        return False
    return bool(np.array_equal(half[::-1], -half))


def table_entries(stages: int, dim: int, bits: int) -> int:
    """Floats of one query row's tables for :data:`TABLE` keys (see :class:`TableKeys`):
    ``stages * (dim / 2) * 2 * 2**bits * 2``."""
    return stages * (dim // 2) * 2 * (1 << bits) * 2


def sketch_matrix(proj: mx.array, m: int, mo: int, lanes: int) -> mx.array:
    """``S`` (``proj``, ``(R, D)``) as the sketch keys' pass reads it: its first ``m`` rows
    (and, when ``mo`` differs from ``m``, then its first ``mo`` rows) transposed, each set's
    rows in the lanes' order: lane ``j`` of ``lanes`` owns rows ``j * n / lanes + i``, stored
    in column ``i * lanes + j``, so that a warp's lanes read one contiguous run of a channel's
    row. ``q @ sketch_matrix(...)[:, :m]`` is ``S q`` in the order the kernel reads it.

    Shapes:
        proj ``(R, D)``, ``R >= max(m, mo)``; returns ``(D, m)`` or ``(D, m + mo)``.
    """
    d = proj.shape[1]

    def block(n: int) -> mx.array:
        rows = proj[:n].reshape(lanes, n // lanes, d)
        return mx.transpose(rows, (2, 1, 0)).reshape(d, n)

    if not mo or mo == m:
        return mx.contiguous(block(m))
    return mx.contiguous(mx.concatenate([block(m), block(mo)], axis=1))


_DUMMY: dict[mx.Dtype, mx.array] = {}


def unused_input(dtype: mx.Dtype) -> mx.array:
    """An unused 8-element input (kept at 8 so Metal passes it in device memory)."""
    hit = _DUMMY.get(dtype)
    if hit is None:
        hit = _DUMMY[dtype] = mx.zeros((8,), dtype=dtype)
    return hit


def code_inputs(c: CodeRecord) -> tuple[mx.array, mx.array, mx.array, mx.array]:
    """One side's four inputs of the portable kernel (``kc, ka, kb, klv`` or ``vc, va, vb,
    vlv``), per record type; placeholders where a layout has none."""
    kind = c.kind
    if kind in (AFFINE, AFFINE_CHANNEL):
        return c.codes, c.scale, c.zero, unused_input(mx.float32)
    if kind == SKETCH:  # sign words, norms, outlier norms
        return (
            c.codes,
            c.norm,
            c.onorm if c.onorm is not None else unused_input(c.norm.dtype),
            unused_input(mx.float32),
        )
    if kind == VQ:  # indices; the codebooks (B * H tables, contiguous) in the levels' place
        table = _device_floats(mx.contiguous(c.codebooks.astype(mx.float32)).reshape(-1))
        return c.codes, unused_input(mx.float16), unused_input(mx.float16), table
    if kind == TABLE:  # indices, norms, positions; the pairs' frequencies in the levels' place
        return c.codes, c.norm, c.positions, _device_floats(c.table.theta.astype(mx.float32))
    levels = _device_floats(c.levels.astype(mx.float32))
    return c.codes, c.norm, unused_input(c.norm.dtype), levels


def _device_floats(x: mx.array) -> mx.array:
    """A 1-D float32 input padded to 8 elements at least: kept in device memory on Metal
    (MLX passes smaller inputs as constants; the body only indexes it)."""
    if x.size < 8:
        return mx.concatenate([x, mx.zeros((8 - x.size,), mx.float32)])
    return x


def sketch_inputs(keys: CodeRecord, q_sketch: mx.array | None, rows: int) -> list[mx.array]:
    """The portable kernel's last five inputs (``ksg, krn, qsk, kix, kst``): the keys'
    residual sketch, its norms and the sketched query (rows padded to ``rows``); for
    :class:`SketchCodes` the outlier sketch, a placeholder, the sketched query, the outlier
    indices and ``S``; for :class:`TableCodes` the query tables (``q_sketch``, see
    :class:`TableKeys`) in the sketched query's place; unused placeholders where a side has
    none of them."""
    u32, f16, f32 = unused_input(mx.uint32), unused_input(mx.float16), unused_input(mx.float32)
    if keys.table is not None:
        return [u32, f16, pad_rows(q_sketch.astype(mx.float32), rows), u32, f32]
    if keys.sketch is not None:
        sk = keys.sketch
        qs = pad_rows(q_sketch.astype(mx.float32), rows)
        if not sk.outliers:
            return [u32, f16, qs, u32, f32]
        return [sk.osign, f16, qs, sk.idx, sk.matrix]
    if keys.signs is None:
        return [u32, f16, f32, u32, f32]
    return [keys.signs, keys.rnorm, pad_rows(q_sketch.astype(mx.float32), rows), u32, f32]


def _check_sketch(c: SketchCodes, b: int, h: int, t: int, dim: int) -> None:
    """Shapes of :class:`SketchCodes` (see :class:`SketchKeys`)."""
    sk = c.sketch
    want = {"codes": (b, h, t, -(-sk.m // 32)), "norm": (b, h, t)}
    got = {"codes": c.codes, "norm": c.norm}
    if sk.outliers and (sk.mo < 1 or sk.index_bits != max(1, (dim - 1).bit_length())):
        raise ValueError(
            "decode_attention: sketch keys with outliers need an outlier sketch (mo >= 1) and "
            f"indices of ceil(log2 {dim}) bits, got mo={sk.mo}, index_bits={sk.index_bits}"
        )
    if sk.outliers:
        blocks = -(-t // c.group)
        want.update(
            onorm=(b, h, t),
            osign=(b, h, t, -(-sk.mo // 32)),
            idx=(b, h, blocks, -(-sk.outliers * sk.index_bits // 32)),
        )
        got.update(onorm=c.onorm, osign=sk.osign, idx=sk.idx)
    elif c.onorm is not None or sk.osign is not None or sk.idx is not None or sk.mo:
        raise ValueError("decode_attention: sketch keys without outliers have no outlier arrays")
    for name, shape in want.items():
        a = got[name]
        if a is None or tuple(a.shape) != shape:
            have = None if a is None else tuple(a.shape)
            raise ValueError(f"decode_attention: sketch keys' {name} is {have}, expected {shape}")
    for name in ("codes", "osign", "idx"):
        if name in got and got[name].dtype != mx.uint32:
            raise ValueError(f"decode_attention: sketch keys' {name} must be uint32")
    cols = sk.m if not sk.mo or sk.mo == sk.m else sk.m + sk.mo
    if sk.outliers and tuple(sk.matrix.shape) != (dim, cols):
        raise ValueError(
            f"decode_attention: the sketch matrix is {tuple(sk.matrix.shape)}, expected "
            f"{(dim, cols)} (sketch_matrix)"
        )


def _check_vq(name: str, c: VQCodes, b: int, h: int, t: int, dim: int) -> None:
    """Shapes of :class:`VQCodes`: indices and one codebook per batch row and KV head."""
    if dim % c.group:
        raise ValueError(
            f"decode_attention: {name} sub-vectors of {c.group} channels do not divide the "
            f"head dim {dim}"
        )
    words = -(-(dim // c.group) * c.bits // 32)
    if tuple(c.codes.shape) != (b, h, t, words) or c.codes.dtype != mx.uint32:
        raise ValueError(
            f"decode_attention: {name} VQ codes {tuple(c.codes.shape)} {c.codes.dtype} do not "
            f"match (B, H, T, W) = {(b, h, t, words)} uint32"
        )
    want = (b, h, 1 << c.bits, c.group)
    cb = c.codebooks
    if tuple(cb.shape) != want or not mx.issubdtype(cb.dtype, mx.floating):
        raise ValueError(
            f"decode_attention: {name} codebooks are {(tuple(cb.shape), cb.dtype)}, expected "
            f"float (B, H, 2**bits, group) = {want}"
        )


def _check_table(c: TableCodes, b: int, h: int, t: int, dim: int) -> None:
    """Shapes of :class:`TableCodes` (see :class:`TableKeys`)."""
    tk = c.table
    if dim % 2 or (dim // 2) % c.group:
        raise ValueError(
            f"decode_attention: table keys of {c.bits}-bit indices per {c.group} pairs do not "
            f"code a {dim}-dim head (bits 1 to 8, pairs per code dividing {dim // 2})"
        )
    if not isinstance(tk.stages, int) or tk.stages < 1:
        raise ValueError(f"decode_attention: table keys need stages >= 1, got {tk.stages!r}")
    words = -(-tk.stages * (dim // 2 // c.group) * 2 * c.bits // 32)
    if tuple(c.codes.shape) != (b, h, t, words) or c.codes.dtype != mx.uint32:
        raise ValueError(
            f"decode_attention: table keys' codes {tuple(c.codes.shape)} {c.codes.dtype} do not "
            f"match (B, H, T, W) = {(b, h, t, words)} uint32"
        )
    if tuple(c.norm.shape) != (b, h, t):
        raise ValueError(
            f"decode_attention: table keys' norms are {tuple(c.norm.shape)}, expected {(b, h, t)}"
        )
    pos = c.positions
    if tuple(pos.shape) != (b, 1, t) or pos.dtype != mx.int32:
        raise ValueError(
            f"decode_attention: table keys' positions are {(tuple(pos.shape), pos.dtype)}, "
            f"expected (B, 1, T) = {(b, 1, t)} int32"
        )
    if tuple(tk.theta.shape) != (dim // 2,) or tk.theta.dtype != mx.float32:
        raise ValueError(
            f"decode_attention: table keys' theta is {tuple(tk.theta.shape)} {tk.theta.dtype}, "
            f"expected ({dim // 2},) float32"
        )


def check_codes(name: str, c: CodeRecord, b: int, h: int, t: int, dim: int) -> None:
    """Shapes and dtypes of one side's record (``name``: ``"key"`` or ``"value"``) against a
    ``(B, H, T)`` segment of head dim ``dim``; sketch and table codes are keys only. What the
    record's construction checked (widths, its arrays present) is not checked again."""
    kind = c.kind
    if kind == TABLE:
        if name != "key":
            raise ValueError("decode_attention: table codes are for keys only")
        _check_table(c, b, h, t, dim)
        return
    if kind == VQ:
        _check_vq(name, c, b, h, t, dim)
        return
    if kind == SKETCH:
        if name != "key":
            raise ValueError("decode_attention: sketch codes are for keys only")
        _check_sketch(c, b, h, t, dim)
        return
    if kind == CODEBOOK and c.dim != dim:
        raise ValueError(
            f"decode_attention: {name} codebook codes are for head dim {c.dim}, the segment's "
            f"is {dim}"
        )
    if c.signs is not None:
        if tuple(c.signs.shape) != (b, h, t, dim // 32) or c.signs.dtype != mx.uint32:
            raise ValueError(
                f"decode_attention: {name} signs {tuple(c.signs.shape)} {c.signs.dtype} do not "
                f"match (B, H, T, D/32) = {(b, h, t, dim // 32)} uint32"
            )
        if tuple(c.rnorm.shape) != (b, h, t):
            raise ValueError(f"decode_attention: {name} rnorm does not have shape {(b, h, t)}")
    words = -(-dim * c.bits // 32)
    if tuple(c.codes.shape) != (b, h, t, words) or c.codes.dtype != mx.uint32:
        raise ValueError(
            f"decode_attention: {name} codes {tuple(c.codes.shape)} {c.codes.dtype} do not match "
            f"(B, H, T, W) = {(b, h, t, words)} uint32"
        )
    if kind == AFFINE_CHANNEL and t % c.group:
        raise ValueError(
            f"decode_attention: {name} tokens ({t}) must be whole groups of {c.group} for "
            "per-channel scales"
        )
    want = {
        AFFINE: (b, h, t, dim // c.group),
        AFFINE_CHANNEL: (b, h, t // c.group, dim),
    }.get(kind, (b, h, t))
    if tuple(c.a.shape) != want or (kind != CODEBOOK and tuple(c.b.shape) != want):
        raise ValueError(f"decode_attention: {name} scales/norms do not have shape {want}")


def pad_rows(x: mx.array, rows: int) -> mx.array:
    """``x (B, H, R, D)`` with zero rows appended up to ``rows``."""
    b, h, r, d = x.shape
    return x if rows <= r else mx.concatenate([x, mx.zeros((b, h, rows - r, d), x.dtype)], axis=2)
