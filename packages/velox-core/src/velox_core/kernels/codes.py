"""What the decode kernels take from the code records (:mod:`velox_core.kernels.records`).

One record describes a segment's keys or values; its layout
(:mod:`velox_core.kernels.layout`, looked up by record class) says how the kernels read it.
Here: the kernels' inputs built from a record (:func:`code_inputs`, :func:`sketch_inputs`),
the shape checks against the query's head dim (:func:`check_codes`), through the record's
layout, and the helpers of the core layouts (:func:`levels_symmetric`, :func:`qmul_bits`,
:func:`float_bits`).
"""

from __future__ import annotations

import struct

import mlx.core as mx
import numpy as np

from .layout import layout_of
from .records import CodeRecord

__all__ = [
    "FP16_MAX",
    "LOG2E",
    "check_codes",
    "code_inputs",
    "float_bits",
    "levels_symmetric",
    "qmul_bits",
    "sketch_inputs",
]

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


def code_inputs(c: CodeRecord) -> tuple[mx.array, mx.array, mx.array, mx.array]:
    """One side's four inputs of the portable kernel (``kc, ka, kb, klv`` or ``vc, va, vb,
    vlv``): its layout's (:meth:`velox_core.kernels.layout.Layout.inputs`)."""
    return layout_of(c).inputs(c)


def sketch_inputs(keys: CodeRecord, q_sketch: mx.array | None, rows: int) -> list[mx.array]:
    """The portable kernel's last five inputs (``ksg, krn, qsk, kix, kst``): the keys'
    query-side inputs (:meth:`velox_core.kernels.layout.Layout.query_inputs`; the sketched
    query or query tables padded to ``rows``), placeholders where the keys take none."""
    return layout_of(keys).query_inputs(keys, q_sketch, rows)


def check_codes(name: str, c: CodeRecord, b: int, h: int, t: int, dim: int) -> None:
    """Shapes and dtypes of one side's record (``name``: ``"key"`` or ``"value"``) against a
    ``(B, H, T)`` segment of head dim ``dim`` (:meth:`velox_core.kernels.layout.Layout.check`);
    a keys-only layout is refused as values. What the record's construction checked (widths,
    its arrays present) is not checked again."""
    lay = layout_of(c)
    if name != "key" and lay.keys_only:
        raise ValueError(f"decode_attention: {lay.name} codes are for keys only")
    lay.check(name, c, b, h, t, dim)
