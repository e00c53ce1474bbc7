"""QJL's code layout for velox-core's decode kernels: sketch keys.

QJL's keys are sign sketches (:class:`SketchCodes`, :class:`SketchKeys`): the portable
kernel scores them with the key pass this package ships (``metal/decode_sketch_keys.metal``,
placed in its body: :class:`SketchLayout`), and on NVIDIA GPUs records laid out for it take
the tensor-core sketch kernel (:mod:`velox_qjl.sketch_mma`). Its settings
(:class:`QJLKernelConfig`: ``VELOX_DECODE_SKETCH_LANES``, ``VELOX_SKETCH_MMA_*``) are read
from the environment once. Registered with velox-core's layouts when this module is
imported.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

import mlx.core as mx

from velox_core.kernels.layout import Layout, float_bits, pad_rows, register_layout, unused_input
from velox_core.kernels.portable import MAX_REGS
from velox_core.kernels.records import CodeRecord, check_record

from .settings import SKETCH, QJLKernelConfig

__all__ = [
    "SKETCH",
    "SKETCH_LANES",
    "QJLKernelConfig",
    "SketchCodes",
    "SketchKeys",
    "SketchLayout",
    "sketch_lanes",
    "sketch_matrix",
    "sketch_rows",
]


@dataclass(slots=True, kw_only=True)
class SketchCodes(CodeRecord):
    """QJL keys: the sign bits of a sketch of each key, its norm and, per
    block of ``group`` tokens, outlier channels with their own sketch (:class:`SketchKeys`).
    Keys only; one bit a sign (``bits`` is 1).

    Attributes:
        codes: ``(B, H, T, m/32)`` uint32: the ``m`` sign bits of the main sketch.
        norm: the norms ``||k_in||`` ``(B, H, T)``.
        onorm: the outlier parts' norms ``||k_o||`` ``(B, H, T)``, None without outliers.
        group: tokens per outlier block (1 where there are none).
        sketch: the sketch's sizes and its other arrays.
    """

    kind: ClassVar[int] = SKETCH
    bits: ClassVar[int] = 1
    codes: mx.array
    norm: mx.array
    sketch: SketchKeys = field()
    onorm: mx.array | None = None
    group: int = 1

    def __post_init__(self) -> None:
        arrays = ("codes", "norm") if self.onorm is None else ("codes", "norm", "onorm")
        check_record(self, arrays, width=False)
        if not isinstance(self.sketch, SketchKeys):
            raise ValueError(
                f"SketchCodes: sketch must be a SketchKeys record, got {type(self.sketch).__name__}"
            )

    @property
    def a(self) -> mx.array:
        return self.norm

    @property
    def b(self) -> mx.array | None:
        return self.onorm


@dataclass(frozen=True)
class SketchKeys:
    """QJL keys as the kernels read them, beside :class:`SketchCodes`.

    A key's score is ``c/m ||k_in|| <S q - S P q, sign(S k_in)> + c/m_o ||k_o|| <S P q,
    sign(S k_o)>``: ``P`` keeps the block's outlier channels, ``k_o = P k``, ``k_in = k - k_o``,
    the outlier sketch using the first ``m_o`` rows of ``S``. The kernel forms ``S P q`` per
    block of tokens from the block's channel indices and ``S``'s columns, which it reads from
    ``S`` laid out in its lanes' order (:func:`sketch_matrix`); the
    host passes ``S q`` in the same order (the query times that matrix's first ``m`` columns).

    Attributes:
        m: sign bits of the main sketch.
        mo: sign bits of the outlier sketch (0 without outliers).
        outliers: outlier channels per block (0: none).
        index_bits: bits of one packed channel index.
        const: the estimator's ``c``.
        lanes: the lanes per token ``sketch_lanes`` gave, for which ``matrix`` is laid out.
        matrix: ``sketch_matrix`` of ``S`` for ``lanes`` (any float dtype).
        osign: the outlier sketch's sign bits ``(B, H, T, mo/32)`` uint32, or None.
        idx: the packed channel indices ``(B, H, T/block, W)`` uint32, or None.
        mma: ``matrix`` is laid out for the tensor-core sketch kernel instead
            (:func:`velox_qjl.sketch_mma.sketch_mma_matrix`, float16; ``lanes`` 0),
            which then takes the segment (:func:`velox_qjl.sketch_mma.supported`).
    """

    m: int
    mo: int
    outliers: int
    index_bits: int
    const: float
    lanes: int
    matrix: mx.array
    osign: mx.array | None = None
    idx: mx.array | None = None
    mma: bool = False


def sketch_rows(m: int, mo: int, outliers: int, lanes: int) -> int:
    """The most query rows the key pass holds in registers: their weights within
    ``MAX_REGS``, their outlier coordinates within half of it."""
    rows = MAX_REGS // ((m + mo) // lanes)
    return min(rows, (MAX_REGS // 2) // outliers) if outliers else rows


def _word_fit(bits: int) -> bool:
    """A lane's run of sign bits is at most one word (read from the one or two words it
    lies in) or whole words."""
    return 1 <= bits <= 32 or bits % 32 == 0


SKETCH_LANES = 32  # most lanes per token of the key pass (QJLKernelConfig.lanes)


def sketch_lanes(m: int, mo: int) -> int:
    """Lanes per token of the key pass for sketch keys of ``m`` (and ``mo`` outlier) sign
    bits: the most (a power of two, at most ``QJLKernelConfig.lanes``, default
    :data:`SKETCH_LANES`: the fewest weights per lane) that split both sketches evenly into
    shares of at most one word or of whole words; 0 when none does."""
    top = QJLKernelConfig.current().lanes
    for lanes in (32, 16, 8, 4, 2, 1):
        if lanes > top:
            continue
        if m % lanes or mo % lanes:
            continue
        if _word_fit(m // lanes) and (mo == 0 or _word_fit(mo // lanes)):
            return lanes
    return 0


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


class SketchLayout(Layout):
    """How the kernels read :class:`SketchCodes`: sign bits of a sketch of each key with
    per-block outlier channels (keys only; their query-side input: the sketched query
    ``S q``). The key pass this package ships (``metal/decode_sketch_keys.metal``) spreads a
    token's sign bits over :func:`sketch_lanes` lanes and adds their sums by a butterfly;
    splits hold whole outlier blocks. Records laid out for the tensor-core sketch kernel
    (``SketchKeys.mma``) take it instead (:meth:`own_kernel`, CUDA)."""

    kind = SKETCH
    record = SketchCodes
    name = "sketch"
    keys_only = True
    mixes_values = False
    wide = False
    butterfly = True
    key_pass = "decode_sketch_keys.metal"
    package = "velox_qjl"

    def lanes_ok(self, bits, group, dim, cpl):
        return True

    def inputs(self, c):  # sign words, norms, outlier norms
        onorm = c.onorm if c.onorm is not None else unused_input(c.norm.dtype)
        return c.codes, c.norm, onorm, unused_input(mx.float32)

    def query_shape(self, c, b, h, m, dim):
        return (b, h, m, c.sketch.m)

    def query_token_inputs(self, c):
        return (0, 3) if c.sketch.outliers else ()  # the outlier sketch and block indices

    def key_rows(self, c, dim):
        sk = c.sketch
        lanes = sketch_lanes(sk.m, sk.mo)
        if not lanes:
            return 0
        if sk.lanes and sk.lanes != lanes:
            raise ValueError(
                f"decode_attention: the sketch matrix is laid out for {sk.lanes} lanes, the "
                f"plan takes {lanes} (sketch_lanes at call time)"
            )
        return sketch_rows(sk.m, sk.mo, sk.outliers, lanes)

    def split_block(self, c):
        return c.group if c.sketch.outliers else 1

    def constants(self, c, dim):
        sk = c.sketch
        return [
            ("KSK", sk.m),
            ("KOSK", sk.mo),
            ("KOUT", sk.outliers),
            ("KIB", sk.index_bits if sk.outliers else 0),
            ("KLPT", sketch_lanes(sk.m, sk.mo)),
            ("KCIN", float_bits(sk.const / sk.m)),
            ("KCOUT", float_bits(sk.const / sk.mo) if sk.outliers else 0),
        ]

    def own_kernel(self, q_shape, keys, values, splits, scale):
        if not keys.sketch.mma:
            return None
        from .sketch_mma import decode_sketch_mma, supported

        if not supported(q_shape[2], q_shape[3], keys, values):
            raise ValueError(
                "decode_attention: the sketch keys are laid out for the tensor-core sketch "
                "kernel (SketchKeys.mma), which does not take this segment (sketch_mma.supported)"
            )

        def parts(q, qs):
            return decode_sketch_mma(q, keys, values, splits, scale, qs)

        return parts

    def query_inputs(self, c, q_side, rows):
        sk = c.sketch
        qs = pad_rows(q_side.astype(mx.float32), rows)
        if not sk.outliers:
            u32, f16, f32 = (unused_input(d) for d in (mx.uint32, mx.float16, mx.float32))
            return [u32, f16, qs, u32, f32]
        return [sk.osign, unused_input(mx.float16), qs, sk.idx, sk.matrix]

    def check(self, name, c, b, h, t, dim):
        sk = c.sketch
        want = {"codes": (b, h, t, -(-sk.m // 32)), "norm": (b, h, t)}
        got = {"codes": c.codes, "norm": c.norm}
        if sk.outliers and (sk.mo < 1 or sk.index_bits != max(1, (dim - 1).bit_length())):
            raise ValueError(
                "decode_attention: sketch keys with outliers need an outlier sketch (mo >= 1) "
                f"and indices of ceil(log2 {dim}) bits, got mo={sk.mo}, "
                f"index_bits={sk.index_bits}"
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
            raise ValueError(
                "decode_attention: sketch keys without outliers have no outlier arrays"
            )
        for part, shape in want.items():
            a = got[part]
            if a is None or tuple(a.shape) != shape:
                have = None if a is None else tuple(a.shape)
                raise ValueError(
                    f"decode_attention: sketch keys' {part} is {have}, expected {shape}"
                )
        for part in ("codes", "osign", "idx"):
            if part in got and got[part].dtype != mx.uint32:
                raise ValueError(f"decode_attention: sketch keys' {part} must be uint32")
        cols = sk.m if not sk.mo or sk.mo == sk.m else sk.m + sk.mo
        if sk.outliers and tuple(sk.matrix.shape) != (dim, cols):
            raise ValueError(
                f"decode_attention: the sketch matrix is {tuple(sk.matrix.shape)}, expected "
                f"{(dim, cols)} (sketch_matrix)"
            )


register_layout(SketchLayout())
