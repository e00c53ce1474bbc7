"""CommVQ's code layout for velox-core's portable decode kernel: table keys.

CommVQ's keys are indices of RoPE-commutative codewords with a norm and a position a token
(:class:`TableCodes`, :class:`TableKeys`); the kernel scores them from query tables the host
builds once per call, with the key pass this package ships (``metal/decode_table_keys.metal``,
placed in the portable kernel's body: :class:`TableLayout`). Registered with velox-core's
layouts (:func:`velox_core.kernels.layout.register_layout`) when this module is imported.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

import mlx.core as mx

from velox_core.kernels.layout import (
    Layout,
    device_floats,
    pad_rows,
    register_layout,
    unused_input,
)
from velox_core.kernels.records import CodeRecord, check_record

__all__ = ["TABLE", "TableCodes", "TableKeys", "TableLayout", "table_entries"]

TABLE = 5  # the kernel's KKIND of table keys


@dataclass(frozen=True)
class TableKeys:
    """CommVQ keys as the kernel reads them, beside :class:`TableCodes` (arXiv 2506.18879).

    A key is ``k_p = n e^{i t theta_p} sum_s (A[s, p, c1] + J B[s, p, c2])`` per RoPE pair
    ``p`` (pairs as complex numbers: ``n`` its norm, ``t`` its position, ``c1, c2`` the
    indices its group of ``G`` pairs took at stage ``s``). The codewords, ``J`` and the
    rotation commute, so ``q . k = n sum_p Re(e^{i t theta_p} W_p)`` with ``W_p = sum_s
    (TA[s, p, c1] + TB[s, p, c2])``, ``TA = conj(q_p) A``, ``TB = conj(q_p) J B``: the host
    builds those tables once per call (the query against every codeword, MLX ops) and passes
    them as the kernel's query-side input, ``(B, H, M, E)`` float32 with ``E =``
    :func:`table_entries`, entry ``(((s * P + p) * 2 + book) * K + k) * 2 + c`` (``book`` 0:
    ``TA``, 1: ``TB``; ``c`` 0: real part, 1: imaginary part). The kernel reads each key's
    codes, sums its looked-up 2-vectors per pair, rotates the sums by the key's angle
    (``t theta_p``, from its position and ``theta``), adds the pairs and scales by the norm;
    no key is decoded.

    ``TableCodes.codes`` holds per token the ``S * (P / G) * 2`` indices of
    ``TableCodes.bits`` bits in one bit stream (velox's packing), stage by stage, group by
    group, ``c1`` then ``c2``.

    Attributes:
        stages: residual stages ``S``.
        theta: ``(D/2,)`` float32: radians per position of each pair, in the codes' pair
            order (0 for the channels RoPE leaves alone).
    """

    stages: int
    theta: mx.array


@dataclass(slots=True, kw_only=True)
class TableCodes(CodeRecord):
    """CommVQ keys: indices of RoPE-commutative codewords, a norm and a position a token,
    scored from per-call query tables (:class:`TableKeys`). Keys only.

    Attributes:
        bits: bits of one of a group's two indices, ``log2 K`` (1 to 8).
        group: RoPE pairs per code (``G``).
        codes: ``(B, H, T, W)`` uint32: per token the ``S * (P / G) * 2`` indices, ``bits``
            each, in one bit stream (see :class:`TableKeys`).
        norm: ``(B, H, T)``.
        positions: ``(B, 1, T)`` int32, one a token for all heads.
        table: the stages and RoPE frequencies.
    """

    kind: ClassVar[int] = TABLE
    bits: int
    group: int
    codes: mx.array
    norm: mx.array
    positions: mx.array
    table: TableKeys = field()

    def __post_init__(self) -> None:
        check_record(self, ("codes", "norm", "positions"))
        if not isinstance(self.table, TableKeys):
            raise ValueError(
                f"TableCodes: table must be a TableKeys record, got {type(self.table).__name__}"
            )

    @property
    def a(self) -> mx.array:
        return self.norm

    @property
    def b(self) -> mx.array:
        return self.positions


def table_entries(stages: int, dim: int, bits: int) -> int:
    """Floats of one query row's tables for table keys (see :class:`TableKeys`):
    ``stages * (dim / 2) * 2 * 2**bits * 2``."""
    return stages * (dim // 2) * 2 * (1 << bits) * 2


class TableLayout(Layout):
    """How the portable decode kernel reads :class:`TableCodes`: a lane owns ``CPL / 2``
    pairs, whole code groups whose indices of one stage fill one word's aligned share or
    whole words; the pairs' frequencies are the kernel's table (``KOLV = D / 2``), the query
    tables its query-side input, ``KSTG`` the stages."""

    kind = TABLE
    record = TableCodes
    name = "table"
    keys_only = True
    mixes_values = False
    wide = False
    key_pass = "decode_table_keys.metal"
    package = "velox_commvq"

    def lanes_ok(self, bits, group, dim, cpl):
        pairs = cpl // 2
        if not 1 <= bits <= 8 or group < 1 or pairs % group:
            return False
        lane_bits = pairs // group * 2 * bits  # of one stage
        return lane_bits % 32 == 0 or 32 % lane_bits == 0

    def inputs(self, c):  # indices, norms, positions; the pairs' frequencies as the table
        return c.codes, c.norm, c.positions, device_floats(c.table.theta.astype(mx.float32))

    def query_shape(self, c, b, h, m, dim):
        return (b, h, m, table_entries(c.table.stages, dim, c.bits))

    def query_inputs(self, c, q_side, rows):
        u32, f16, f32 = unused_input(mx.uint32), unused_input(mx.float16), unused_input(mx.float32)
        return [u32, f16, pad_rows(q_side.astype(mx.float32), rows), u32, f32]

    def table_floats(self, c, dim):
        return dim // 2

    def constants(self, c, dim):
        return [("KSTG", c.table.stages)]

    def check(self, name, c, b, h, t, dim):
        tk = c.table
        if dim % 2 or (dim // 2) % c.group:
            raise ValueError(
                f"decode_attention: table keys of {c.bits}-bit indices per {c.group} pairs do "
                f"not code a {dim}-dim head (bits 1 to 8, pairs per code dividing {dim // 2})"
            )
        if not isinstance(tk.stages, int) or tk.stages < 1:
            raise ValueError(f"decode_attention: table keys need stages >= 1, got {tk.stages!r}")
        words = -(-tk.stages * (dim // 2 // c.group) * 2 * c.bits // 32)
        if tuple(c.codes.shape) != (b, h, t, words) or c.codes.dtype != mx.uint32:
            raise ValueError(
                f"decode_attention: table keys' codes {tuple(c.codes.shape)} {c.codes.dtype} do "
                f"not match (B, H, T, W) = {(b, h, t, words)} uint32"
            )
        if tuple(c.norm.shape) != (b, h, t):
            raise ValueError(
                f"decode_attention: table keys' norms are {tuple(c.norm.shape)}, expected "
                f"{(b, h, t)}"
            )
        pos = c.positions
        if tuple(pos.shape) != (b, 1, t) or pos.dtype != mx.int32:
            raise ValueError(
                f"decode_attention: table keys' positions are {(tuple(pos.shape), pos.dtype)}, "
                f"expected (B, 1, T) = {(b, 1, t)} int32"
            )
        if tuple(tk.theta.shape) != (dim // 2,) or tk.theta.dtype != mx.float32:
            raise ValueError(
                f"decode_attention: table keys' theta is {tuple(tk.theta.shape)} "
                f"{tk.theta.dtype}, expected ({dim // 2},) float32"
            )


register_layout(TableLayout())
