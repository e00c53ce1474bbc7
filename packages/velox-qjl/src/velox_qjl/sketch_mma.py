"""Decode attention over QJL keys on NVIDIA tensor cores (``metal/decode_attention_sketch_mma.cu``,
shipped by this package).

QJL keys are sign sketches: a key's score is ``c/m ||k_in|| <S q - S P q, sign(S k_in)> +
c/m_o ||k_o|| <S P q, sign(S k_o)>`` (:class:`velox_qjl.layout.SketchKeys`). The
signs are ``+-1``, so per 16-token tile both inner products are fp16 MMAs with float32
accumulation: the tokens' signs (exact as fp16 ``+-1``, two per register from one shift and
one logic op) against the sketched query; per outlier block, ``S P q`` is an MMA of the query's
outlier coordinates (fp16 hi and lo parts) and the block's columns of ``S``, whose result lands
in the layout the score MMAs take; the values (per-token affine codes) are mixed by MMAs as in
velox-core's affine tensor-core kernel (``decode_attention_mma.cu``). The portable kernel
(with this package's key pass) spends one FMA per sign bit and query row instead.

The kernel reads ``S`` and ``S q`` in its own order of the sketch's rows (:func:`order`): lane
``t`` of a token takes a contiguous quarter of its sign words, and register pairs hold bits
``j`` and ``j + 16`` of a word. :func:`sketch_mma_matrix` is ``S`` laid out so (velox-qjl keeps
it beside the projection, as it keeps the portable kernel's copy), and ``q`` times its first
``m`` columns is ``S q`` in that order.

Layouts it takes (:func:`supported`): sketches of whole 32-bit words (``m`` and ``m_o``
multiples of 32, at most :data:`MAX_SKETCH`), at most 16 outlier channels per block of a
multiple of 16 tokens, at most 8 query rows per KV head, and per-token affine values of 2, 4
or 8 bits whose eighth of the head dim fills whole words, with fp16 or bfloat16 norms, scales
and zeros. Others take the portable kernel.
"""

from __future__ import annotations

import math

import mlx.core as mx
import numpy as np

import velox_core.kernels as _kernels  # backend() looked up per call (tests report another)
from velox_core.kernels.build import KernelSpec
from velox_core.kernels.layout import check_codes, float_bits, qmul_bits, unused_input
from velox_core.kernels.mma import MMA_SCALE_DTYPES, mma_splits
from velox_core.kernels.mma_support import mma_enabled
from velox_core.kernels.records import AFFINE, CodeRecord

from .settings import SKETCH, QJLKernelConfig

__all__ = [
    "DECODE_SKETCH_MMA",
    "b_diff",
    "decode_sketch_mma",
    "fragment_plan",
    "frags_shared",
    "layout_supported",
    "order",
    "sketch_mma_matrix",
    "sketch_mma_template",
    "sketch_splits",
    "supported",
    "tiles_ahead",
    "wanted",
]

DECODE_SKETCH_MMA = KernelSpec(
    name="velox_decode_sketch_mma",
    source="decode_attention_sketch_mma.cu",
    package="velox_qjl",
    inputs=("q", "qs", "ks", "kn", "ko", "kon", "kix", "kst", "vc", "va", "vb"),
    outputs=("ml_part", "o_part"),
    row_contiguous=False,  # the body reads strides: slices of a cache buffer are not copied
    cuda_headers=("velox_mma.cuh",),
)
NWARPS = 4  # warps per threadgroup
# threadgroups an SM runs at once, for the split count: 4 warps at 250-254 registers (nvcc,
# sm_90a) fit twice (an H200, 128k, batch 1: 235.3 us a call against 294.9 sized for 3; batch 8
# 1,666.6 against 2,010.4; the first version)
SM_BLOCKS = 2
MAX_SKETCH = 1024  # most sign bits of either sketch (S q in shared memory)
MAX_OUTLIERS = 16  # outlier channels per block (one MMA's k)
MAX_DIM = 256  # head dims up to this (the query in shared memory)
SMEM_FLOATS = 12 * 1024  # 48 KiB of static shared memory
# B-fragment words a lane keeps in registers: the paper's setting (m 256, outliers sharing it,
# at most 4 query rows) holds 64 and compiles to 250 registers without spills (nvcc 13, sm_90a);
# m 320 with m_o 64 (88 with S q's fragments) spilled 292 bytes, so past this the main sketch's
# B is S q - S P q (b_diff, 48 there) or S q's fragments go to shared memory (frags_shared)
FRAG_WORDS = 66
AHEAD_WORDS = 48  # fragment words up to which tiles are loaded two ahead (tiles_ahead)


def order(n: int) -> np.ndarray:
    """The kernel's order of ``n`` sketch rows (``n`` a multiple of 32): ``order(n)[r]`` is
    the sketch row (the bit of the packed sign words) of the kernel's column ``r``.

    Column ``r = 16 i + c`` is k-step ``i``'s column ``c`` of the MMA; with ``W = n // 128``,
    lane ``t = (c % 8) // 2`` reads words ``[t W, (t + 1) W)`` of a token's row, and its
    register pair ``j`` holds bits ``j`` (column ``c`` even) and ``j + 16`` (odd) of word
    ``i // 8``, with ``j = 2 (i % 8)`` for columns below 8 and ``j + 1`` above. The k-steps past
    ``8 W`` read the row's last words, shared: a 64-bit part (``n % 128 >= 64``), lane ``t``
    taking pairs ``8 (t % 2)`` on of word ``4 W + t // 2``, then a 32-bit part (``n % 64``),
    lane ``t`` taking pairs ``4 t`` on of the last word; k-step ``8 W + i'`` takes the part's
    pairs ``2 (i' % 4)`` (below 8) and ``+ 1`` (above) past the lane's first."""
    if n % 32 or n < 32:
        raise ValueError(f"sketch_mma.order: n must be a positive multiple of 32, got {n}")
    w, half = n // 128, n % 128 >= 64
    r = np.arange(n)
    i, c = r // 16, r % 16
    t, odd, upper = (c % 8) // 2, c % 2, c // 8
    whole = i < 8 * w
    rest = i - 8 * w  # k-steps into the shared words
    pair = 2 * (rest % 4) + upper + 16 * odd  # the bit in the lane's shifted word
    in64 = half & (rest < 4)
    word = np.where(whole, t * w + i // 8, np.where(in64, 4 * w + t // 2, 4 * w + 2 * half))
    bit = np.where(
        whole, 2 * (i % 8) + upper + 16 * odd, np.where(in64, pair + 8 * (t % 2), pair + 4 * t)
    )
    return 32 * word + bit


def sketch_mma_matrix(proj: mx.array, m: int, mo: int) -> mx.array:
    """``S`` (``proj``, ``(R, D)``) as the kernel reads it: its first ``m`` rows in
    :func:`order`, transposed, then (when ``mo`` is neither 0 nor ``m``) its first ``mo`` rows
    likewise; float16 (the codec keeps ``S`` in float16, so this is exact).

    Shapes:
        returns ``(D, m)`` or ``(D, m + mo)``."""

    def block(n: int) -> mx.array:
        return mx.take(proj[:n], mx.array(order(n).astype(np.int32)), axis=0).T

    cols = block(m) if not mo or mo == m else mx.concatenate([block(m), block(mo)], axis=1)
    return mx.contiguous(cols.astype(mx.float16))


def layout_supported(rows: int, dim: int, m: int, mo: int, outliers: int, group: int) -> bool:
    """Whether the kernel lays out QJL keys of ``m`` (and ``mo``) sign bits, ``outliers``
    channels per block of ``group`` tokens, for ``rows`` query rows and head dim ``dim``
    (the key side of :func:`supported`, checked before the kernel's copy of ``S`` is made)."""
    if not 1 <= rows <= 8 or dim % 16 or not 16 <= dim <= MAX_DIM:
        return False
    if m % 32 or not 32 <= m <= MAX_SKETCH:
        return False
    if outliers:
        if outliers > MAX_OUTLIERS or mo % 32 or not 32 <= mo <= MAX_SKETCH or group % 16:
            return False
    elif mo:
        return False
    frags = 2 * m * (4 if _blo(rows) == 1 else 2) if frags_shared(rows, m, mo, outliers) else 0
    held = 4 if _blo(rows) == 2 else 8  # the kernel's rows of S q and q (QR: zero past rows)
    need = held * (m + (dim if outliers else 0)) + frags
    return need <= SMEM_FLOATS and NWARPS * 8 * dim <= SMEM_FLOATS


def _values_supported(dim: int, values: CodeRecord) -> bool:
    if values.kind != AFFINE or values.bits not in (2, 4, 8) or values.levels is not None:
        return False
    if values.a is None or values.b is None or values.a.dtype not in MMA_SCALE_DTYPES:
        return False
    if values.b.dtype != values.a.dtype:
        return False
    lane = dim // 8  # channels a lane decodes
    if (lane * values.bits) % 32 or dim % values.group:
        return False
    g = values.group
    return g % lane == 0 if lane <= g else lane % g == 0


def supported(rows: int, dim: int, keys: CodeRecord, values: CodeRecord) -> bool:
    """Whether the kernel takes this segment: :data:`SKETCH` keys with their matrix laid out
    for it (``SketchKeys.mma``: :func:`sketch_mma_matrix`'s contiguous float16 array, which
    the kernel indexes without strides), a layout :func:`layout_supported` takes, fp16 or
    bfloat16 norms, and per-token affine values (2, 4 or 8 bits, whole words a lane)."""
    sk = keys.sketch
    if keys.kind != SKETCH or sk is None or not sk.mma or sk.matrix.dtype != mx.float16:
        return False
    if keys.a is None or keys.a.dtype not in MMA_SCALE_DTYPES:
        return False
    if sk.outliers and (keys.b is None or keys.b.dtype != keys.a.dtype):
        return False
    if not layout_supported(rows, dim, sk.m, sk.mo, sk.outliers, keys.group):
        return False
    return _values_supported(dim, values)


def wanted(
    rows: int,
    dim: int,
    m: int,
    mo: int,
    outliers: int,
    group: int,
    norm_dtype: mx.Dtype,
    values: CodeRecord,
) -> bool:
    """Whether a QJL segment should be laid out for this kernel: CUDA kernels on (MLX on an
    NVIDIA GPU, ``KernelConfig.mma`` not 0), fp16 or bfloat16 norms (a float32 model's keep
    the portable kernel) and a layout it takes."""
    if _kernels.backend() != "cuda" or not mma_enabled() or norm_dtype not in MMA_SCALE_DTYPES:
        return False
    return layout_supported(rows, dim, m, mo, outliers, group) and _values_supported(dim, values)


def b_residual() -> bool:
    """Whether the sketched query goes into the score MMAs as fp16 plus its rounding residual
    (two MMAs a k-step, the float32 product to about ``2^-22``; the default) or rounded to fp16
    (``QJLKernelConfig.mma_lo`` False, ``VELOX_SKETCH_MMA_LO=0``: one MMA, about ``2^-12``
    relative per entry)."""
    return QJLKernelConfig.current().mma_lo


def _blo(rows: int) -> int:
    """The kernel's ``BLO`` for ``rows`` query rows (:func:`b_residual`)."""
    return (2 if rows <= 4 else 1) if b_residual() else 0


def _frag_words(rows: int, m: int, mo: int, outliers: int, diff: bool) -> int:
    """B-fragment words a lane holds in registers: ``S q``'s (made once; none with ``diff``)
    and an outlier block's (``S P q`` over the main sketch's columns, or ``S q - S P q`` with
    ``diff``, and ``S P q`` over the outlier sketch's own columns), doubled for the residuals
    at more than 4 query rows."""
    per = 2 if _blo(rows) == 1 else 1
    main = 2 * per * (m // 16)
    if not outliers:
        return main
    own = 0 if mo == m else 2 * per * (mo // 16)
    return main + own if diff else 2 * main + own


def fragment_plan(rows: int, m: int, mo: int, outliers: int) -> tuple[bool, bool, int]:
    """Where the kernel keeps its B fragments and how far ahead it loads, for a layout:
    ``(diff, shared, ahead)`` = (:func:`b_diff`, :func:`frags_shared`, :func:`tiles_ahead`),
    worked out in one pass (the template asks for all three)."""
    diff_words = _frag_words(rows, m, mo, outliers, True)
    cfg = QJLKernelConfig.current()
    diff = bool(outliers) and mo != m and cfg.mma_diff is not False
    diff = diff and diff_words <= FRAG_WORDS
    shared = False
    if not diff:
        forced = cfg.mma_bsm
        shared = (
            forced if forced is not None else _frag_words(rows, m, mo, outliers, False) > FRAG_WORDS
        )
    if cfg.mma_ahead is not None:
        ahead = cfg.mma_ahead
    else:
        ahead = 2 if diff and diff_words <= AHEAD_WORDS else 1
    return diff, shared, ahead


def b_diff(rows: int, m: int, mo: int, outliers: int) -> bool:
    """Whether the main sketch's B is ``S q - S P q``, converted per outlier block (``DIFF`` 1:
    one MMA a k-step for the main score, against two for ``<S q, s> - <S P q, s>`` with ``S q``
    made once, and no registers for ``S q``'s fragments): for outlier sketches of columns of
    their own (``mo != m``) whose fragments fit in :data:`FRAG_WORDS`
    (``QJLKernelConfig.mma_diff`` False turns it off). Where the outlier sketch shares the
    main one's columns (the paper's setting) converting ``S P q`` twice a block costs more than
    the second MMA, so such layouts keep two MMAs (docs/performance.md has the timings)."""
    return fragment_plan(rows, m, mo, outliers)[0]


def tiles_ahead(rows: int, m: int, mo: int, outliers: int) -> int:
    """Tiles whose loads are in flight while one is computed (``AHEAD``): 2 with
    :func:`b_diff` and at most :data:`AHEAD_WORDS` fragment words (the registers ``S q``'s
    fragments would take hold a third tile's loads; larger sketches spill), else 1;
    ``QJLKernelConfig.mma_ahead`` (1 or 2) sets it."""
    return fragment_plan(rows, m, mo, outliers)[2]


def frags_shared(rows: int, m: int, mo: int, outliers: int) -> bool:
    """Whether ``S q``'s B fragments go to shared memory (``BSM`` 1) rather than registers:
    when it has fragments (not :func:`b_diff`) and all those a lane holds exceed
    :data:`FRAG_WORDS`; where it has them, ``QJLKernelConfig.mma_bsm`` (0 or 1) sets it."""
    return fragment_plan(rows, m, mo, outliers)[1]


def sketch_mma_template(
    dim: int, rows: int, keys: CodeRecord, values: CodeRecord, scale: float | None = None
) -> list[tuple[str, object]]:
    """The kernel's template arguments for a segment :func:`supported` takes."""
    sk = keys.sketch
    k = sk.outliers
    diff, shared, ahead = fragment_plan(rows, sk.m, sk.mo if k else 0, k)
    return [
        ("HD", dim),
        ("MROWS", rows),
        ("SKM", sk.m),
        ("SKO", sk.mo if k else 0),
        ("KOUT", k),
        ("KIB", sk.index_bits if k else 1),
        ("KGRP", keys.group if k else 16),
        ("SHARE", int(bool(k) and sk.mo == sk.m)),
        ("NSBF", int(keys.a.dtype == mx.bfloat16)),
        ("VSBF", int(values.a.dtype == mx.bfloat16)),
        ("VBITS", values.bits),
        ("VGROUP", values.group),
        ("QMUL", qmul_bits(scale)),
        ("CMB", float_bits(sk.const / sk.m)),
        ("COB", float_bits(sk.const / sk.mo) if k else 0),
        ("BLO", _blo(rows)),
        ("BSM", int(shared)),
        ("DIFF", int(diff)),
        ("AHEAD", ahead),
        ("NWARPS", NWARPS),
    ]


def sketch_splits(tokens: int, rows: int, group: int) -> int:
    """Splits of ``tokens`` for ``rows`` (batch x KV head) threadgroup rows: the tensor-core
    kernel's wave sizing (:func:`velox_core.kernels.mma.mma_splits`), each split a whole
    number of outlier blocks (the kernel rounds a split's span up to them)."""
    s = mma_splits(tokens, rows, NWARPS, SM_BLOCKS)
    align = max(16, group)
    span = math.ceil(math.ceil(tokens / s) / align) * align
    return math.ceil(tokens / span)


def decode_sketch_mma(
    q: mx.array,
    keys: CodeRecord,
    values: CodeRecord,
    splits: int | None,
    scale: float | None,
    q_sketch: mx.array | None,
) -> tuple[mx.array, mx.array, mx.array] | None:
    """The kernel's per-split partials ``(o_part, ml_part)`` and the query it took, or None
    where :func:`supported` declines.

    Shapes:
        q ``(B, H, M, D)``: float32 with the scale applied, or unscaled with ``scale``;
        q_sketch ``(B, H, M, m)`` float32: ``q`` times ``keys.sketch.matrix[:, :m]``.
        Returns ``(B, H, S, M, D)``, ``(B, H, S, M, 2)`` float32 and ``q``.
    """
    b, h, m, dim = q.shape
    t = keys.codes.shape[2]
    if not supported(m, dim, keys, values):
        return None
    sk = keys.sketch
    if q_sketch is None or tuple(q_sketch.shape) != (b, h, m, sk.m):
        raise ValueError(f"decode_sketch_mma: q_sketch must be {(b, h, m, sk.m)} float32")
    check_codes("key", keys, b, h, t, dim)
    check_codes("value", values, b, h, t, dim)
    grp = keys.group if sk.outliers else 16
    if splits is None:
        s = sketch_splits(t, b * h, grp)
    else:
        if not isinstance(splits, int) or isinstance(splits, bool) or splits < 1:
            raise ValueError(f"decode_sketch_mma: splits must be a positive int, got {splits!r}")
        s = splits
    k = sk.outliers
    u32, nd = unused_input(mx.uint32), unused_input(keys.a.dtype)
    nt = NWARPS * 32
    ml_part, o_part = DECODE_SKETCH_MMA.kernel()(
        inputs=[
            q,
            q_sketch.astype(mx.float32),
            keys.codes,
            keys.a,
            sk.osign if k else u32,
            keys.b if k else nd,
            sk.idx if k else u32,
            sk.matrix,
            values.codes,
            values.a,
            values.b,
        ],
        template=sketch_mma_template(dim, m, keys, values, scale),
        grid=(s * nt, b * h, 1),
        threadgroup=(nt, 1, 1),
        output_shapes=[(b, h, s, m, 2), (b, h, s, m, dim)],
        output_dtypes=[mx.float32, mx.float32],
    )
    return o_part, ml_part, q
