"""Fused decode attention over packed codes (flash-decoding), for the GPU kernels.

One pass over the codes of a segment computes, for a few grouped query rows, the partial
``(o, m, l)`` of :func:`velox_core.cache.attention.partial`: ``o = sum_t exp(s_t - m) v_t``,
``m`` the row max of the scores and ``l = sum_t exp(s_t - m)``, all float32, so that
:func:`velox_core.cache.attention.merge_partials` joins it with the other segments into one
softmax. The context is split into chunks so that one sequence fills the GPU: every
threadgroup handles one chunk (``metal/decode_attention.metal``) and a second small kernel
merges the chunks with the log-sum-exp rule (``metal/decode_merge.metal``).

Keys and values are each either **affine** per-group codes (``x = scale * code + zero``, one
scale and zero per ``group`` channels of a token: :class:`velox_core.Uniform` with
``axis="token"``) or **codebook** codes (``x = norm * levels[code]``, one norm per token:
TurboQuant_mse in the rotated domain) or **vector** codes (:data:`VQ`: each sub-vector of
``group`` channels is the index of a codeword, ``x = codebook[code]``, one codebook per batch
row and KV head: VecInfer). Keys may also be **sketch** codes (:data:`SKETCH`,
QJL: ``m`` sign bits of ``S k`` and ``||k||`` per token, with per-block outlier channels and
their own sketch, see :class:`SketchKeys`). Codes are uint32 words in velox's packing layout
(:mod:`velox_core.ops.packing`), any width 1 to 8 where a lane's channels fill whole words.

:func:`plan` says whether (and how) a shape is supported; :func:`decode_attention` returns
None where it is not, so callers fall back to the reference.

Shapes:
    q ``(B, H, M, D)`` float32 with the scale applied; codes ``(B, H, T, ceil(D*bits/32))``
    uint32; affine scale/zero ``(B, H, T, D/group)``; codebook norm ``(B, H, T)`` and levels
    ``(2**bits,)``. Returns ``o (B, H, M, D)``, ``m`` and ``l`` ``(B, H, M, 1)``.
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import math
import struct
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import numpy as np

from .. import kernels as _kernels  # backend() looked up per call (tests report another)
from . import env_setting
from .build import KernelSpec

__all__ = [
    "AFFINE",
    "AFFINE_CHANNEL",
    "CODEBOOK",
    "DECODE",
    "DECODE_MMA",
    "FP16_MAX",
    "MERGE",
    "MERGE_FP16",
    "SKETCH",
    "VQ",
    "VQ_MAX_TABLE",
    "Codes",
    "MmaLaunch",
    "MmaLayout",
    "Plan",
    "SketchKeys",
    "block_splits",
    "choose_splits",
    "decode_attention",
    "fit_splits",
    "merge_launch",
    "merge_splits",
    "merge_splits_fp16",
    "mma_enabled",
    "mma_fuse_merge",
    "mma_launch",
    "mma_layout",
    "mma_p_residual",
    "mma_pipeline",
    "mma_sm_blocks",
    "mma_spec",
    "mma_splits",
    "mma_stages",
    "mma_subtiles",
    "mma_supported",
    "mma_template",
    "mma_warps",
    "plan",
    "plan_for",
    "qmul_bits",
    "sketch_lanes",
    "sketch_matrix",
    "template",
    "tuning",
]

AFFINE, CODEBOOK, AFFINE_CHANNEL, SKETCH, VQ = 0, 1, 2, 3, 4
# most floats of one side's VQ codebook (codewords x channels) the portable kernel keeps in
# threadgroup memory: 4 KiB a side beside the 16 KiB of scores (Metal allows 32 KiB)
VQ_MAX_TABLE = 1024
NWARPS = 4  # warps per threadgroup (VELOX_DECODE_WARPS overrides: 1, 2, 4 or 8)
UNROLL = 4  # tokens per lane per loop iteration, loads issued together (VELOX_DECODE_UNROLL)
MAX_REGS = 64  # query rows x channels per lane held in registers (and as many accumulators)
# the same on CUDA for lanes of 32 channels (3-, 5- and 7-bit codes): 4 query rows a pass, where
# 64 would take 2 and read the codes twice; 208-247 registers, no spills (nvcc sm_90a); on
# an H200 at 128k, 3-bit codes 13-17% faster at batch 1 (sixteenth session)
CUDA_WIDE_REGS = 128
SCORE_SLOTS = 4096  # (token, row) scores a threadgroup keeps (16 KiB): a split's tokens <= 4096/mb
MAX_MERGE_FLOATS = 4096  # the warp merge (nwarps x mb x head dim floats) reuses those 16 KiB
DEFAULT_BLOCKS = 1024  # threadgroups to aim for (several waves on a large GPU)
MIN_SPAN = 256  # fewest tokens per split (unless the context is shorter)

DECODE = KernelSpec(
    name="velox_decode_attention",
    source="decode_attention.metal",
    inputs=(
        *("q", "kc", "ka", "kb", "klv", "vc", "va", "vb", "vlv"),
        *("ksg", "krn", "qsk", "kix", "kst"),
    ),
    outputs=("o_part", "ml_part"),
    row_contiguous=False,  # the body reads strides: slices of a cache buffer are not copied
)
DECODE_MMA = KernelSpec(
    name="velox_decode_attention_mma",
    source="decode_attention_mma.cu",
    # kl / vl: a codebook side's levels (KCB / VCB), else unused
    inputs=("q", "kc", "ka", "kb", "vc", "va", "vb", "kl", "vl"),
    # one float32 workspace: the partials, and with FUSE = 1 the merged result and the counts
    # (mma_layout); one output, so the launch's zero fill (FUSE = 1) is one fill
    outputs=("ws",),
    row_contiguous=False,
    cuda_headers=("velox_mma.cuh",),
)
# the same kernel leaving the merge to a second launch (FUSE = 0): the partials as two outputs
# of their own shapes, (m, l) in ws and the outputs in wo, so the merge reads them without views
DECODE_MMA_PARTS = dataclasses.replace(
    DECODE_MMA,
    name="velox_decode_attention_mma_parts",
    outputs=("ws", "wo"),
    defines=("VX_MMA_PARTS 1",),
)
# one MMA on subnormal codes: whether the tensor cores take them exactly (the folds rely on it)
PROBE_SUBNORMAL = KernelSpec(
    name="velox_probe_subnormal_mma",
    source="probe_subnormal_mma.cu",
    inputs=("salt_in",),
    outputs=("out",),
    cuda_headers=("velox_mma.cuh",),
)
MERGE = KernelSpec(
    name="velox_decode_merge",
    source="decode_merge.metal",
    inputs=("o_part", "ml_part"),
    outputs=("o", "m", "l"),
)
MERGE_FP16 = KernelSpec(
    name="velox_decode_merge_fp16",
    source="decode_merge_fp16.metal",
    inputs=("o_part", "ml_part", "q", "ak", "av", "bk", "bv", "rot"),
    outputs=("o", "m", "l"),
    row_contiguous=False,  # the fp16 segments are slices of cache buffers
)
FP16_MAX = 2048  # most fp16 tokens (sinks + window) the fused merge takes
LOG2E = 1.4426950408889634


def qmul_bits(scale: float | None = None) -> int:
    """The ``QMUL`` template value: the float32 bits of ``log2(e)`` (times ``scale``, for
    queries that come unscaled), the factor the tensor-core kernel and the fp16 merge apply to
    the queries."""
    return _float_bits(LOG2E * (1.0 if scale is None else float(scale)))


def _float_bits(x: float) -> int:
    """The float32 bits of ``x`` as a signed int (a template value)."""
    return struct.unpack("<i", struct.pack("<f", float(x)))[0]


# not frozen: a decode step builds two of these per layer, and a frozen dataclass's
# __init__ (object.__setattr__ per field) costs several times a plain one's; treat as immutable
@dataclass
class Codes:
    """One side (keys or values) of a segment, as the kernel reads it.

    Attributes:
        kind: :data:`AFFINE`, :data:`CODEBOOK`, :data:`AFFINE_CHANNEL` (keys only:
            per-channel groups along tokens, KIVI's keys), :data:`VQ` or :data:`SKETCH`.
        bits: code width, 1 to 8 (:data:`VQ`: bits of one codeword index).
        group: affine: channels per (scale, zero); per-channel affine: tokens per (scale,
            zero); VQ: channels per sub-vector (1, 2, 4 or 8); codebook: ignored.
        codes: ``(B, H, T, W)`` uint32 packed codes (:data:`VQ`: the ``D / group`` indices of a
            token, ``bits`` each, in one bit stream).
        a: affine scale ``(B, H, T, D/group)``, per-channel scale ``(B, H, T/group, D)``, or
            codebook norm ``(B, H, T)``; None for :data:`VQ`.
        b: affine zero, shaped like ``a``; None for a codebook and :data:`VQ`.
        levels: codebook levels ``(2**bits,)`` float32; :data:`VQ`: the codebooks ``(B, H,
            2**bits, group)`` (any float dtype; row ``code`` of ``(b, h)`` is the sub-vector);
            None for affine.
        signs: codebook keys with a QJL residual sketch (TurboQuant_prod): ``(B, H, T, D/32)``
            uint32, bit ``e`` set where channel ``e`` of the residual's sketch is positive;
            the caller passes the sketched query to :func:`decode_attention`. None otherwise.
        rnorm: with ``signs``: the residual norms ``(B, H, T)``.
        sketch: :data:`SKETCH` keys only (QJL): the sketch's sizes and its other arrays; then
            ``codes`` holds the ``m`` sign bits ``(B, H, T, m/32)``, ``a`` the norms
            ``(B, H, T)``, ``b`` the outlier parts' norms (None without outliers), ``bits``
            is 1 and ``group`` the tokens per outlier block (1 without outliers).
        symmetric: codebook only: the caller vouches that the levels are ascending and
            ``levels[2**bits - 1 - c] == -levels[c]`` in fp16 (Lloyd-Max levels of a law
            symmetric about 0, checked on the host once per codebook:
            :func:`levels_symmetric`); the tensor-core kernel then looks 4-bit codes up in
            half the table and forms 2-bit ones without a permute (``KCB`` / ``VCB`` 2).
            False: any levels.
    """

    kind: int
    bits: int
    group: int
    codes: mx.array
    a: mx.array | None
    b: mx.array | None = None
    levels: mx.array | None = None
    signs: mx.array | None = None
    rnorm: mx.array | None = None
    sketch: SketchKeys | None = None
    symmetric: bool = False


def levels_symmetric(levels) -> bool:
    """Whether codebook ``levels`` (host values: a numpy array or a list of floats) are
    ascending and symmetric about 0 in fp16, ``fp16(L[n - 1 - c]) == -fp16(L[c])`` for every
    code ``c``: what :attr:`Codes.symmetric` vouches for. One host check per codebook; never
    on a device array in a decode step (it would wait for the device)."""
    lev = np.asarray(levels, dtype=np.float32).reshape(-1)
    with np.errstate(over="ignore"):  # past fp16's range: infinite, refused below
        half = lev.astype(np.float16)
    if lev.size < 2 or not np.all(np.isfinite(half)) or np.any(np.diff(half) < 0):
        return False
    return bool(np.array_equal(half[::-1], -half))


@dataclass(frozen=True)
class SketchKeys:
    """QJL keys (velox-qjl's codec) as the portable kernel reads them, beside :class:`Codes`.

    A key's score is ``c/m ||k_in|| <S q - S P q, sign(S k_in)> + c/m_o ||k_o|| <S P q,
    sign(S k_o)>``: ``P`` keeps the block's outlier channels, ``k_o = P k``, ``k_in = k - k_o``,
    the outlier sketch using the first ``m_o`` rows of ``S``. The kernel forms ``S P q`` per
    block of tokens from the block's channel indices and ``S``'s columns, which it reads from
    ``S`` laid out in its lanes' order (:func:`sketch_matrix`); the host passes ``S q`` in
    the same order (the query times that matrix's first ``m`` columns).

    Attributes:
        m: sign bits of the main sketch.
        mo: sign bits of the outlier sketch (0 without outliers).
        outliers: outlier channels per block (0: none).
        index_bits: bits of one packed channel index.
        const: the estimator's ``c``.
        lanes: the lanes per token :func:`sketch_lanes` gave, for which ``matrix`` is laid out.
        matrix: :func:`sketch_matrix` of ``S`` for ``lanes`` (any float dtype).
        osign: the outlier sketch's sign bits ``(B, H, T, mo/32)`` uint32, or None.
        idx: the packed channel indices ``(B, H, T/block, W)`` uint32, or None.
        mma: ``matrix`` is laid out for the tensor-core sketch kernel instead
            (:func:`velox_core.kernels.sketch_mma.sketch_mma_matrix`, float16; ``lanes`` 0),
            which then takes the segment (:func:`velox_core.kernels.sketch_mma.supported`).
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


@dataclass(frozen=True)
class Plan:
    """How the kernel lays out one shape (all compile-time constants of the body).

    Attributes:
        cpl: channels per lane; a token's row is spread over ``lanes = D / cpl`` lanes.
        mb: query rows per threadgroup (``nmb`` blocks of them cover the ``M`` rows).
        nmb: query-row blocks (grid z).
        lanes: lanes per token, a power of two (``D / cpl`` rounded up).
        nwarps: warps per threadgroup.
        unroll: tokens per lane per loop iteration.
        step: tokens a threadgroup consumes per loop iteration.
        max_span: most tokens one split may hold (its scores stay in threadgroup memory).
        klanes: :data:`SKETCH` keys: lanes per token of the key pass (0 otherwise).
    """

    cpl: int
    mb: int
    nmb: int
    lanes: int
    nwarps: int
    unroll: int
    step: int
    max_span: int
    klanes: int = 0


def _pow2_ceil(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _side_ok(kind: int, bits: int, group: int, dim: int, cpl: int) -> bool:
    if kind == SKETCH:  # the key pass has its own lane layout (sketch_lanes)
        return True
    if kind == VQ:  # whole sub-vectors a lane, its indices in whole words; the table fits
        return (
            1 <= bits <= 8
            and group in (1, 2, 4, 8)
            and cpl % group == 0
            and (cpl // group * bits) % 32 == 0
            and (1 << bits) * group <= VQ_MAX_TABLE
        )
    if not 1 <= bits <= 8 or (cpl * bits) % 32:
        return False
    if kind == AFFINE:
        return group >= 1 and dim % group == 0 and (group % cpl == 0 or cpl % group == 0)
    if kind == AFFINE_CHANNEL:
        return group >= 1
    return kind == CODEBOOK


def _pow2_floor(n: int) -> int:
    return 1 << (max(1, n).bit_length() - 1)


def tuning() -> tuple[int, int]:
    """``(warps per threadgroup, unroll)``: the defaults, or ``VELOX_DECODE_WARPS`` and
    ``VELOX_DECODE_UNROLL`` (for tuning on a new GPU)."""
    nw = int(env_setting("VELOX_DECODE_WARPS", NWARPS))
    un = int(env_setting("VELOX_DECODE_UNROLL", UNROLL))
    if nw not in (1, 2, 4, 8):
        raise ValueError(f"VELOX_DECODE_WARPS must be 1, 2, 4 or 8, got {nw}")
    if not 1 <= un <= 16:
        raise ValueError(f"VELOX_DECODE_UNROLL must be 1 to 16, got {un}")
    return nw, un


def plan(
    m: int,
    dim: int,
    kkind: int,
    kbits: int,
    kgroup: int,
    vkind: int,
    vbits: int,
    vgroup: int,
    sketch: bool = False,
    qjl: tuple[int, int] | None = None,
) -> Plan | None:
    """The kernel's layout for ``m`` query rows of head dim ``dim``, or None if unsupported.

    Channels per lane (8, 16 or 32) must fill whole code words for both widths and divide the
    head dim into at most 32 lanes; affine groups must hold whole lanes or whole sub-blocks
    of one. Query rows and channels per lane share a register budget of :data:`MAX_REGS`
    (:data:`CUDA_WIDE_REGS` for 32 channels a lane on CUDA; half of :data:`MAX_REGS` with a
    key ``sketch``: the sketched query takes the other half); rows per
    threadgroup are a power of two (at most 8). A sketch needs codebook keys and a head dim
    that is a multiple of 32. :data:`VQ` codes need whole sub-vectors per lane, a lane's
    indices filling whole words, and a codebook of at most :data:`VQ_MAX_TABLE` floats.

    :data:`SKETCH` keys (QJL) pass ``qjl = (m, mo, outliers)``: the key pass spreads a
    token's sign bits over :func:`sketch_lanes` lanes, and each query row holds
    ``m / lanes + mo / lanes`` weights (at most :data:`MAX_REGS` for all rows) and the query's
    ``outliers`` coordinates of a block (at most half of it); with outliers, a block of
    ``kgroup`` tokens must fit one split.
    """
    if m < 1 or dim < 1 or vkind == AFFINE_CHANNEL:  # per-channel groups: keys only
        return None
    if sketch and (kkind != CODEBOOK or dim % 32):
        return None
    if (kkind == SKETCH) != (qjl is not None):
        raise ValueError("plan: sketch keys (SKETCH) and qjl=(m, mo, outliers) go together")
    klanes = 0
    budget = MAX_REGS // 2 if sketch else MAX_REGS
    if qjl is not None:
        klanes = sketch_lanes(qjl[0], qjl[1])
        if not klanes or _sketch_rows(qjl, klanes) < 1:
            return None
    nwarps, unroll = tuning()
    order = (32, 16, 8) if m <= 2 else (16, 32, 8) if m <= 4 else (8, 16, 32)
    for cpl in order:
        if dim % cpl or dim // cpl > 32:
            continue
        if not (
            _side_ok(kkind, kbits, kgroup, dim, cpl) and _side_ok(vkind, vbits, vgroup, dim, cpl)
        ):
            continue
        regs = budget
        if cpl == 32 and not sketch and qjl is None and kkind != VQ and vkind != VQ:
            regs = CUDA_WIDE_REGS if _kernels.backend() == "cuda" else budget
        if regs < cpl:
            continue
        mb = min(regs // cpl, _pow2_ceil(m), 8)
        while mb > 1 and nwarps * mb * dim > MAX_MERGE_FLOATS:
            mb //= 2
        if nwarps * mb * dim > MAX_MERGE_FLOATS:
            continue
        mb = _pow2_floor(mb)
        lanes = _pow2_ceil(dim // cpl)
        step = nwarps * (32 // lanes) * unroll
        if qjl is not None:
            mb = min(mb, _pow2_floor(_sketch_rows(qjl, klanes)))
            if qjl[2] and kgroup > SCORE_SLOTS // mb:  # a block must fit one split
                return None
        return Plan(cpl, mb, -(-m // mb), lanes, nwarps, unroll, step, SCORE_SLOTS // mb, klanes)
    return None


def _sketch_rows(qjl: tuple[int, int, int], lanes: int) -> int:
    """The most query rows the sketch key pass holds in registers: their weights within
    :data:`MAX_REGS`, their outlier coordinates within half of it."""
    m, mo, outliers = qjl
    rows = MAX_REGS // ((m + mo) // lanes)
    return min(rows, (MAX_REGS // 2) // outliers) if outliers else rows


def _word_fit(bits: int) -> bool:
    """A lane's run of sign bits is at most one word (read from the one or two words it
    lies in) or whole words."""
    return 1 <= bits <= 32 or bits % 32 == 0


SKETCH_LANES = 32  # most lanes per token of the sketch keys' pass (VELOX_DECODE_SKETCH_LANES)


def sketch_lanes(m: int, mo: int) -> int:
    """Lanes per token of the key pass for sketch keys of ``m`` (and ``mo`` outlier) sign
    bits: the most (a power of two, at most ``VELOX_DECODE_SKETCH_LANES``, default
    :data:`SKETCH_LANES`: the fewest weights per lane) that split both sketches evenly into
    shares of at most one word or of whole words; 0 when none does."""
    top = int(env_setting("VELOX_DECODE_SKETCH_LANES", SKETCH_LANES))
    if top not in (1, 2, 4, 8, 16, 32):
        raise ValueError(f"VELOX_DECODE_SKETCH_LANES must be 1, 2, 4, 8, 16 or 32, got {top}")
    for lanes in (32, 16, 8, 4, 2, 1):
        if lanes > top:
            continue
        if m % lanes or mo % lanes:
            continue
        if _word_fit(m // lanes) and (mo == 0 or _word_fit(mo // lanes)):
            return lanes
    return 0


def plan_for(m: int, dim: int, keys: Codes, values: Codes) -> Plan | None:
    """:func:`plan` for the two sides of a segment."""
    sk = keys.sketch
    qjl = None if sk is None else (sk.m, sk.mo, sk.outliers)
    return plan(
        m,
        dim,
        keys.kind,
        keys.bits,
        keys.group,
        values.kind,
        values.bits,
        values.group,
        keys.signs is not None,
        qjl,
    )


def choose_splits(tokens: int, rows: int, p: Plan) -> int:
    """Splits of a ``tokens``-long context for ``rows`` (batch x KV heads) sequences.

    Aims at ``VELOX_DECODE_BLOCKS`` threadgroups (default :data:`DEFAULT_BLOCKS`) with at least
    :data:`MIN_SPAN` tokens each, and never more than ``p.max_span`` tokens per split; every
    split is non-empty (the kernel takes ``ceil(T / splits)`` tokens per split).
    """
    target = int(env_setting("VELOX_DECODE_BLOCKS", DEFAULT_BLOCKS))
    want = max(1, math.ceil(target / max(1, rows * p.nmb)))
    s = max(1, min(want, math.ceil(tokens / max(MIN_SPAN, p.step))))
    return fit_splits(tokens, s, p)


def fit_splits(tokens: int, splits: int, p: Plan) -> int:
    """``splits`` adjusted so that no split is empty and none holds more than ``p.max_span``."""
    s = max(1, min(int(splits), tokens), math.ceil(tokens / p.max_span))
    return math.ceil(tokens / math.ceil(tokens / s))


def block_splits(tokens: int, splits: int, p: Plan, keys: Codes) -> int:
    """``splits`` adjusted for sketch keys with outlier blocks: the kernel rounds a split's
    ``ceil(T / splits)`` tokens up to whole blocks, so the count is raised until that span
    fits ``p.max_span``, then lowered to the splits the span needs (none empty). Unchanged
    for other keys; :func:`plan` declines blocks longer than a split."""
    if keys.sketch is None or not keys.sketch.outliers or keys.group <= 1:
        return splits
    g = keys.group
    if g > p.max_span:
        raise ValueError(f"block_splits: blocks of {g} tokens exceed a split's {p.max_span}")

    def span(s: int) -> int:  # the kernel's tokens per split
        return math.ceil(math.ceil(tokens / s) / g) * g

    s = splits
    while span(s) > p.max_span:
        s += 1
    return math.ceil(tokens / span(s))


MERGE_THREADS = 256  # the merge body assumes 8 warps per threadgroup


def merge_launch(rows: int, dim: int) -> tuple[tuple[int, int, int], tuple[int, int, int]]:
    """Grid and threadgroup of the merge kernel: one threadgroup per (query row, 32 channels)."""
    return (rows * -(-dim // 32) * MERGE_THREADS, 1, 1), (MERGE_THREADS, 1, 1)


_DUMMY: dict[mx.Dtype, mx.array] = {}


def _dummy(dtype: mx.Dtype) -> mx.array:
    """An unused 8-element input (kept at 8 so Metal passes it in device memory)."""
    hit = _DUMMY.get(dtype)
    if hit is None:
        hit = _DUMMY[dtype] = mx.zeros((8,), dtype=dtype)
    return hit


def _inputs(c: Codes) -> tuple[mx.array, mx.array, mx.array, mx.array]:
    if c.kind in (AFFINE, AFFINE_CHANNEL):
        return c.codes, c.a, c.b, _dummy(mx.float32)
    if c.kind == SKETCH:  # sign words, norms, outlier norms
        return c.codes, c.a, c.b if c.b is not None else _dummy(c.a.dtype), _dummy(mx.float32)
    if c.kind == VQ:  # indices; the codebooks (B * H tables, contiguous) in the levels' place
        table = mx.contiguous(c.levels.astype(mx.float32)).reshape(-1)
        if table.size < 8:
            table = mx.concatenate([table, mx.zeros((8 - table.size,), mx.float32)])
        return c.codes, _dummy(mx.float16), _dummy(mx.float16), table
    levels = c.levels.astype(mx.float32)
    if levels.size < 8:  # keep it in device memory on Metal (the body only indexes it)
        levels = mx.concatenate([levels, mx.zeros((8 - levels.size,), mx.float32)])
    return c.codes, c.a, _dummy(c.a.dtype), levels


def _sketch_inputs(keys: Codes, q_sketch: mx.array | None, rows: int) -> list[mx.array]:
    """The portable kernel's last five inputs (``ksg, krn, qsk, kix, kst``): the keys'
    residual sketch, its norms and the sketched query (rows padded to ``rows``); for
    :data:`SKETCH` keys the outlier sketch, a placeholder, the sketched query, the outlier
    indices and ``S``; unused placeholders where a side has none of them."""
    u32, f16, f32 = _dummy(mx.uint32), _dummy(mx.float16), _dummy(mx.float32)
    if keys.sketch is not None:
        sk = keys.sketch
        qs = _pad_rows(q_sketch.astype(mx.float32), rows)
        if not sk.outliers:
            return [u32, f16, qs, u32, f32]
        return [sk.osign, f16, qs, sk.idx, sk.matrix]
    if keys.signs is None:
        return [u32, f16, f32, u32, f32]
    return [keys.signs, keys.rnorm, _pad_rows(q_sketch.astype(mx.float32), rows), u32, f32]


def _check_sketch(c: Codes, b: int, h: int, t: int, dim: int) -> None:
    """Shapes of :data:`SKETCH` keys (see :class:`SketchKeys`)."""
    sk = c.sketch
    if sk is None or c.signs is not None:
        raise ValueError("decode_attention: sketch keys carry a SketchKeys record, no signs")
    want = {"codes": (b, h, t, -(-sk.m // 32)), "a": (b, h, t)}
    got = {"codes": c.codes, "a": c.a}
    if sk.outliers and (sk.mo < 1 or sk.index_bits != max(1, (dim - 1).bit_length())):
        raise ValueError(
            "decode_attention: sketch keys with outliers need an outlier sketch (mo >= 1) and "
            f"indices of ceil(log2 {dim}) bits, got mo={sk.mo}, index_bits={sk.index_bits}"
        )
    if sk.outliers:
        blocks = -(-t // c.group)
        want.update(
            b=(b, h, t),
            osign=(b, h, t, -(-sk.mo // 32)),
            idx=(b, h, blocks, -(-sk.outliers * sk.index_bits // 32)),
        )
        got.update(b=c.b, osign=sk.osign, idx=sk.idx)
    elif c.b is not None or sk.osign is not None or sk.idx is not None or sk.mo:
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


def _check_vq(name: str, c: Codes, b: int, h: int, t: int, dim: int) -> None:
    """Shapes of :data:`VQ` codes: indices and one codebook per batch row and KV head."""
    if c.a is not None or c.b is not None or c.signs is not None or c.sketch is not None:
        raise ValueError(f"decode_attention: {name} VQ codes carry only codes and codebooks")
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
    lv = c.levels
    if lv is None or tuple(lv.shape) != want or not mx.issubdtype(lv.dtype, mx.floating):
        have = None if lv is None else (tuple(lv.shape), lv.dtype)
        raise ValueError(
            f"decode_attention: {name} codebooks are {have}, expected float (B, H, 2**bits, "
            f"group) = {want}"
        )


def _check(name: str, c: Codes, b: int, h: int, t: int, dim: int) -> None:
    if c.symmetric and c.kind != CODEBOOK:
        raise ValueError(f"decode_attention: {name} symmetric=True is for codebook codes only")
    if c.kind == VQ:
        _check_vq(name, c, b, h, t, dim)
        return
    if c.kind == SKETCH:
        if name != "key":
            raise ValueError("decode_attention: sketch codes are for keys only")
        _check_sketch(c, b, h, t, dim)
        return
    if (c.signs is None) != (c.rnorm is None) or (c.signs is not None and c.kind != CODEBOOK):
        raise ValueError(f"decode_attention: {name} signs and rnorm go together, codebook only")
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
    if c.kind == AFFINE_CHANNEL and t % c.group:
        raise ValueError(
            f"decode_attention: {name} tokens ({t}) must be whole groups of {c.group} for "
            "per-channel scales"
        )
    want = {
        AFFINE: (b, h, t, dim // c.group),
        AFFINE_CHANNEL: (b, h, t // c.group, dim),
    }.get(c.kind, (b, h, t))
    if tuple(c.a.shape) != want or (c.kind != CODEBOOK and tuple(c.b.shape) != want):
        raise ValueError(f"decode_attention: {name} scales/norms do not have shape {want}")


def template(
    p: Plan, dim: int, k: Codes, v: Codes, scale: float | None = None
) -> list[tuple[str, int]]:
    """The body's compile-time constants for a plan (``scale``: the attention scale the kernel
    applies to unscaled queries; None when they come scaled)."""
    return [
        ("MB", p.mb),
        ("HD", dim),
        ("KBITS", k.bits),
        ("VBITS", v.bits),
        ("KKIND", k.kind),
        ("VKIND", v.kind),
        ("KGROUP", k.group if k.kind != CODEBOOK else dim),
        ("VGROUP", v.group if v.kind in (AFFINE, VQ) else dim),
        ("CPL", p.cpl),
        ("NWARPS", p.nwarps),
        ("UNROLL", p.unroll),
        ("QMUL", qmul_bits(scale)),
        ("KQJL", int(k.signs is not None)),
        *sketch_template(p, k),
    ]


def sketch_template(p: Plan, k: Codes) -> list[tuple[str, int]]:
    """The key pass's constants for :data:`SKETCH` keys (zeros for the other kinds): the
    sketches' sizes, outliers per block and their index bits, lanes per token, and the float32
    bits of ``c/m`` and ``c/m_o``."""
    sk = k.sketch
    if sk is None:
        return [(n, 0) for n in ("KSK", "KOSK", "KOUT", "KIB", "KLPT", "KCIN", "KCOUT")]
    return [
        ("KSK", sk.m),
        ("KOSK", sk.mo),
        ("KOUT", sk.outliers),
        ("KIB", sk.index_bits if sk.outliers else 0),
        ("KLPT", p.klanes),
        ("KCIN", _float_bits(sk.const / sk.m)),
        ("KCOUT", _float_bits(sk.const / sk.mo) if sk.outliers else 0),
    ]


MMA_BITS = (2, 4, 8)
MMA_MAX_ROWS = 8  # query rows per KV head the tensor-core kernel holds (rows 0-7 of a tile)
MMA_MIN_SPAN = 512  # fewest tokens per split of the tensor-core kernel
MMA_BLOCKS = 512  # threadgroups the tensor-core kernel aims for (measured on an H200)


def mma_enabled() -> bool:
    """The tensor-core kernel is used on CUDA unless ``VELOX_DECODE_MMA=0``."""
    return env_setting("VELOX_DECODE_MMA", "1").strip() not in ("0", "false", "no", "off")


# scale and zero dtypes the tensor-core kernel reads (KSBF / VSBF pick bfloat16 per side)
MMA_SCALE_DTYPES = (mx.float16, mx.bfloat16)
# query dtypes that go into the score MMA as they are (QLO = 0), converted to fp16: exact for
# fp16, and for bfloat16 channels of magnitude 2^-17 to 65504 (8 significant bits within fp16's
# 11 and its subnormal spacing 2^-24; with the key fold's factor 2^-o, from 2^(o - 17)); smaller
# ones round to 2^-25 absolute (QLO = 1 would only add a second MMA of near-zero lo parts)
MMA_HALF_QUERY = (mx.float16, mx.bfloat16)


# codebook code widths the tensor-core kernel looks up in registers (KCB / VCB)
MMA_CODEBOOK_BITS = (2, 4)


def _mma_codebook_side(c: Codes, dim: int, key: bool) -> bool:
    """A codebook side (TurboQuant_mse: one norm a token, ``2**bits`` levels, no residual
    sketch) the tensor-core kernel lays out: 2 or 4 bits, fp16 or bf16 norms, and a head dim
    whose rows fill the fold's ldmatrix layout (keys: whole 16-byte segments and 4 words a
    k-step; values: 8 16-bit units a lane and an even count of 8-unit blocks)."""
    if c.bits not in MMA_CODEBOOK_BITS or c.signs is not None or c.b is not None:
        return False
    if c.a is None or c.a.dtype not in MMA_SCALE_DTYPES or c.a.ndim != 3:
        return False
    if c.levels is None or tuple(c.levels.shape) != (1 << c.bits,):
        return False
    if key:
        return dim % (4 * (32 // c.bits)) == 0 and (dim * c.bits) % 128 == 0
    return dim % (8 * (16 // c.bits)) == 0 and (dim * c.bits // 128) % 2 == 0


def mma_symmetric() -> bool:
    """Whether the tensor-core kernel uses the symmetry of levels a caller vouches for
    (:attr:`Codes.symmetric`; ``KCB`` / ``VCB`` 2): ``VELOX_DECODE_SYMMETRIC`` (default 1; 0
    looks every codebook up as general levels, for comparison)."""
    return _env_flag("VELOX_DECODE_SYMMETRIC", True)


def _codebook_mode(c: Codes) -> int:
    """``KCB`` / ``VCB``: 0 affine, 1 codebook, 2 a codebook the caller vouches is symmetric
    (:attr:`Codes.symmetric`: 4 bits in half the table, 2 bits without permutes) while
    :func:`mma_symmetric` allows it."""
    if c.kind != CODEBOOK:
        return 0
    return 2 if c.symmetric and mma_symmetric() else 1


def _mma_side(c: Codes, dim: int, lane_channels: int) -> bool:
    if c.kind != AFFINE or c.bits not in MMA_BITS or dim % c.group:
        return False
    if (lane_channels * c.bits) % 32 or c.group % (32 // c.bits):
        return False
    if c.a.dtype not in MMA_SCALE_DTYPES or c.b is None or c.b.dtype != c.a.dtype:
        return False
    return lane_channels % c.group == 0 or c.group % lane_channels == 0


def mma_supported(m: int, dim: int, keys: Codes, values: Codes) -> bool:
    """Whether ``decode_attention_mma.cu`` lays out this shape: affine codes of 2, 4 or 8 bits
    with float16 or bfloat16 scales and zeros (one dtype a side) on both sides, at most
    :data:`MMA_MAX_ROWS` query rows, a head dim that is a multiple of 16 whose quarter (keys)
    and eighth (values) fill whole code words, and groups that hold whole code words and whole
    lanes (or lanes whole groups); or codebook codes of 2 or 4 bits with one fp16 or bf16 norm
    a token (TurboQuant_mse, :func:`_mma_codebook_side`) on either side."""
    if not 1 <= m <= MMA_MAX_ROWS or dim % 16:
        return False
    kok = (
        _mma_codebook_side(keys, dim, True)
        if keys.kind == CODEBOOK
        else _mma_side(keys, dim, dim // 4)
    )
    vok = (
        _mma_codebook_side(values, dim, False)
        if values.kind == CODEBOOK
        else _mma_side(values, dim, dim // 8)
    )
    return kok and vok


# static shared memory of one threadgroup (the rest of 48 KiB: row stats and mbarriers)
MMA_SMEM = 48 * 1024 - 1024


# 16-token MMA tiles per loop step (VELOX_DECODE_SUBTILES: 1, 2 or 4), at most: a step takes
# fewer where two ring stages of it do not fit (at four warps: 4 for 2-bit keys and values, 2
# for 4-bit and mixed 2/4-bit codes, 1 for 8-bit ones)
MMA_SUBTILES = 4
MMA_WARPS = 4  # warps per threadgroup of the tensor-core kernel (VELOX_DECODE_MMA_WARPS)


def mma_warps() -> int:
    """Warps per threadgroup of the tensor-core kernel: ``VELOX_DECODE_MMA_WARPS`` or
    :data:`MMA_WARPS`."""
    n = int(env_setting("VELOX_DECODE_MMA_WARPS", MMA_WARPS))
    if n not in (1, 2, 4, 8):
        raise ValueError(f"VELOX_DECODE_MMA_WARPS must be 1, 2, 4 or 8, got {n}")
    return n


MMA_SM_BLOCKS = 3  # threadgroups per SM the register cap aims for (VELOX_DECODE_MMA_SM_BLOCKS)


def mma_sm_blocks(nwarps: int) -> int:
    """Threadgroups of ``nwarps`` warps per SM that the tensor-core kernel's register cap
    (``__launch_bounds__``) allows: ``VELOX_DECODE_MMA_SM_BLOCKS``, else
    :data:`MMA_SM_BLOCKS` x 4 warps' worth of threadgroups (12 warps per SM, 168 registers,
    for steps of one or two tiles alike: with the scores transposed both fit); 0 leaves the
    registers to the compiler."""
    want = env_setting("VELOX_DECODE_MMA_SM_BLOCKS")
    if want is None:
        return MMA_SM_BLOCKS * 4 // nwarps
    n = int(want)
    if not 0 <= n <= 32:
        raise ValueError(f"VELOX_DECODE_MMA_SM_BLOCKS must be 0 to 32, got {n}")
    return n


@functools.cache
def mma_spec(nwarps: int, sm_blocks: int, parts: bool = False) -> KernelSpec:
    """The tensor-core kernel declared for ``nwarps`` warps and ``sm_blocks`` threadgroups per
    SM (0: no bounds); one MLX kernel name per bound, since MLX caches kernels by name.
    ``parts``: the variant that writes its partials as two outputs, ``ml_part (B, H, S, M, 2)``
    and ``o_part (B, H, S, M, D)`` (``FUSE`` 0 only; :data:`DECODE_MMA_PARTS`)."""
    base = DECODE_MMA_PARTS if parts else DECODE_MMA
    if sm_blocks == 0:
        return base
    return dataclasses.replace(
        base,
        name=f"{base.name}_lb{nwarps}x{sm_blocks}",
        cuda_launch_bounds=(32 * nwarps, sm_blocks),
    )


def _env_flag(name: str, default: bool, value: str | None = None) -> bool:
    """A 0/1 setting from the environment, or its ``value`` already read (anything else is a
    clear error)."""
    v = (env_setting(name, "1" if default else "0") if value is None else value).strip()
    if v not in ("0", "1"):
        raise ValueError(f"{name} must be 0 or 1, got {v!r}")
    return v == "1"


def mma_p_residual() -> bool:
    """Whether the tensor-core kernel carries the softmax weights' fp16 rounding residual (a
    second value MMA): ``VELOX_DECODE_P_RESIDUAL`` (default 0: the weights rounded to fp16, as
    flash attention does; about 2^-11 relative per weight)."""
    return _env_flag("VELOX_DECODE_P_RESIDUAL", False)


def mma_pipeline() -> bool:
    """Whether the tensor-core kernel scores the next step before consuming the current one
    (a software pipeline; it needs at least 3 ring stages and applies without the weights'
    residual, see :func:`mma_template`): ``VELOX_DECODE_PIPELINE`` (default 1; with steps of
    two tiles, on and off measured within the run-to-run spread on an H200, see
    docs/performance.md)."""
    return _env_flag("VELOX_DECODE_PIPELINE", True)


def mma_value_fold() -> bool:
    """Whether the tensor-core kernel folds the value scales into the softmax weights where
    the layout allows it (see :func:`mma_fold_ok`): ``VELOX_DECODE_VFOLD`` (default 1)."""
    return _env_flag("VELOX_DECODE_VFOLD", True)


MMA_FOLD_GROUPS = 4  # at most this many value groups per token take VFOLD (registers)
MMA_KEY_FOLD_GROUPS = 2  # at most this many key groups per token take KFOLD (one chain each)


def _probe_code_bits(r: int, k: int, salt: int) -> int:
    """The fp16 bits of element ``(r, k)`` of the probe's A operand (``probe_subnormal_mma.cu``:
    a 4-bit code at bit offset 0 to 6, the subnormal ``code x 2^(o - 24)``)."""
    return ((16 * r + k + salt) % 15 + 1) << ((r + 3 * k + salt) % 7)


def subnormal_probe_expected(salt: int) -> list[float]:
    """The probe's outputs in its C-fragment order (lane ``4 (r % 8) + n // 2``, element
    ``2 (r >= 8) + n % 2``): the row sums of its A operand, exact."""
    sums = [sum(_probe_code_bits(r, k, salt) for k in range(16)) * 2.0**-24 for r in range(16)]
    return [sums[lane // 4 + 8 * (e >> 1)] for lane in range(32) for e in range(4)]


def subnormal_probe_error(out: Any, salt: int) -> float:
    """The probe's largest error relative to the largest expected sum (0.0: exact)."""
    want = subnormal_probe_expected(salt)
    got = [float(x) for x in (out.tolist() if hasattr(out, "tolist") else out)]
    if len(got) != len(want):
        raise ValueError(f"subnormal probe: {len(got)} outputs, expected {len(want)}")
    return max(abs(g - w) for g, w in zip(got, want)) / max(want)


SUBNORMAL_SALT = 5
_SUBNORMALS: dict[int, bool] = {}


def run_subnormal_probe(salt: int = SUBNORMAL_SALT) -> float:
    """Run the probe on the default device (a CUDA GPU): its error (0.0: exact)."""
    (out,) = PROBE_SUBNORMAL.kernel()(
        inputs=[mx.array([salt], dtype=mx.uint32)],
        grid=(32, 1, 1),
        threadgroup=(32, 1, 1),
        output_shapes=[(128,)],
        output_dtypes=[mx.float32],
    )
    return subnormal_probe_error(out, salt)


def mma_subnormals_exact() -> bool:
    """Whether the CUDA device MLX computes on takes fp16 subnormal MMA operands exactly,
    which both folds (``KFOLD``, ``VFOLD``) rely on: the probe is run once per device (checked
    on an H200; a device that flushed them would get scores and values of zero, so the folds
    are then left off). True where no CUDA device computes (nothing runs the folds on
    hardware; the CPU emulation takes subnormals exactly). A probe that cannot run (e.g.
    inside a traced function) leaves the folds off on that device for the process (the
    decoded path is exact either way)."""
    if not (hasattr(mx, "cuda") and mx.cuda.is_available()):
        return True
    dev = mx.default_device()
    if dev.type != mx.DeviceType.gpu:
        return True
    ordinal = getattr(dev, "index", 0) or 0
    if ordinal not in _SUBNORMALS:
        try:
            _SUBNORMALS[ordinal] = run_subnormal_probe() <= 1e-6
        except Exception:  # any failure to run the probe: fold nothing
            _SUBNORMALS[ordinal] = False
    return _SUBNORMALS[ordinal]


def mma_key_fold() -> bool:
    """Whether the tensor-core kernel folds the key scales and zeros out of the score MMA
    where the layout allows it (see :func:`mma_key_fold_ok`): ``VELOX_DECODE_KFOLD``
    (default 1)."""
    return _env_flag("VELOX_DECODE_KFOLD", True)


def mma_key_fold_ok(keys: Codes, dim: int) -> bool:
    """Whether the key scales and zeros can be folded out of the score MMA (``KFOLD``): a
    group holds 4 whole code words (the four lanes of a k-step read adjacent words: 64
    channels or more at 2 bits, 32 at 4, 16 at 8) and a token has at most
    :data:`MMA_KEY_FOLD_GROUPS` groups (one accumulator chain each)."""
    return keys.group % (4 * (32 // keys.bits)) == 0 and dim // keys.group <= MMA_KEY_FOLD_GROUPS


MMA_FUSE_TOKENS = 16384  # the longest context whose splits the decode kernel merges itself


def mma_fuse_merge(tokens: int) -> bool:
    """Whether the tensor-core kernel merges its splits itself where the call has no fp16
    segments: ``VELOX_DECODE_FUSE`` 1 or 0, else up to :data:`MMA_FUSE_TOKENS` tokens.

    Merging in the kernel saves a launch (about 22 µs of host time a call on the H200's host,
    ``gpu_dispatch.py``), but its counters need a zeroed output, and MLX zeroes the whole
    output, partials included, with a fill launch whose device time grows with them (about 5
    µs for 49 splits at batch 1, 128k) while the last threadgroup's merge runs alone at the
    end; a separate merge launch took 4 µs. So short contexts, where a call's host time is
    its cost, merge in the kernel, and long ones in a second launch (batch 1, 128k, 2 bits:
    43.6 µs against 49.5 of device time, docs/performance.md)."""
    v = env_setting("VELOX_DECODE_FUSE")
    if v is None:
        return tokens <= MMA_FUSE_TOKENS
    return _env_flag("VELOX_DECODE_FUSE", True, v)


def mma_value_units(values: Codes, ldsm: bool) -> int:
    """Channels per unit of the lanes' interleaved values with ``VFOLD`` (lane g takes units
    g, 8 + g, ... of a row; an m-tile's 16 channels lie in 8 adjacent units): 16-bit units
    (``ldsm``, the ``VLD`` layout, read by transposing ldmatrix loads) where a group holds 8
    of them; else words at 4 and 8 bits, bytes at 2 bits."""
    units = 16 // values.bits
    if ldsm and values.group % (8 * units) == 0:
        return units
    return 8 // values.bits if values.bits == 2 else 32 // values.bits


def mma_fold_ok(values: Codes, dim: int, p_residual: bool, ldsm: bool = True) -> bool:
    """Whether the value scales can be folded into the weights (``VFOLD``): a group holds 8
    whole units of the lanes' interleaved values (:func:`mma_value_units`: with ``ldsm``
    16-bit units, 64, 32 and 16 channels at 2, 4 and 8 bits; else words at 4 and 8 bits, 64
    and 32 channels, and bytes at 2 bits, 32 channels), a token has at most
    :data:`MMA_FOLD_GROUPS` groups (each adds two float32 sums a lane), and the weights go in
    rounded to fp16 (no residual MMA)."""
    unit = mma_value_units(values, ldsm)
    return (
        not p_residual and values.group % (8 * unit) == 0 and dim // values.group <= MMA_FOLD_GROUPS
    )


def mma_ldsm() -> bool:
    """Whether the tensor-core kernel reads code words out of its ring with ldmatrix (the
    keys with ``KFOLD``, the values with ``VFOLD`` in 16-bit units: ``LDSM`` 1):
    ``VELOX_DECODE_LDSM`` (default 1)."""
    return _env_flag("VELOX_DECODE_LDSM", True)


def mma_subtiles() -> int:
    """16-token MMA tiles per loop step of the tensor-core kernel, at most (the plan halves
    it until two ring stages fit): ``VELOX_DECODE_SUBTILES`` or :data:`MMA_SUBTILES`."""
    n = int(env_setting("VELOX_DECODE_SUBTILES", MMA_SUBTILES))
    if n not in (1, 2, 4):
        raise ValueError(f"VELOX_DECODE_SUBTILES must be 1, 2 or 4, got {n}")
    return n


def mma_stages(dim: int, keys: Codes, values: Codes, nwarps: int, subtiles: int = 1) -> int:
    """Steps (of ``16 * subtiles`` tokens) in each warp's shared-memory ring:
    ``VELOX_DECODE_STAGES`` or the most (up to 4) that fit in 48 KiB of static shared
    memory; 0 if not even 2 fit."""
    tile = 16 * subtiles
    words = tile * dim * (keys.bits + values.bits) // 32
    words += 2 * (-(-tile * (dim // keys.group) // 2)) + 2 * (-(-tile * (dim // values.group) // 2))
    if nwarps * 8 * dim * 4 > MMA_SMEM:
        return 0
    fit = [n for n in (4, 3, 2) if nwarps * n * words * 4 <= MMA_SMEM]
    want = env_setting("VELOX_DECODE_STAGES")
    if want is not None:
        n = int(want)
        if not 2 <= n <= 8:
            raise ValueError(f"VELOX_DECODE_STAGES must be 2 to 8, got {n}")
        return n if nwarps * n * words * 4 <= MMA_SMEM else 0
    return fit[0] if fit else 0


@functools.cache
def _sm_count(ordinal: int) -> int | None:
    try:
        lib = ctypes.CDLL("libcuda.so.1")
        dev, value = ctypes.c_int(), ctypes.c_int()
        if lib.cuInit(0) or lib.cuDeviceGet(ctypes.byref(dev), ordinal):
            return None
        # CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT
        if lib.cuDeviceGetAttribute(ctypes.byref(value), 16, dev):
            return None
    except (OSError, AttributeError):
        return None
    return value.value if value.value > 0 else None


def sm_count() -> int | None:
    """Streaming multiprocessors of the CUDA device MLX computes on (``VELOX_DECODE_SMS``, else
    the CUDA driver's count), or None where neither is known."""
    want = env_setting("VELOX_DECODE_SMS")
    if want is not None:
        if not want.strip().isdigit() or int(want) < 1:
            raise ValueError(f"VELOX_DECODE_SMS must be a positive integer, got {want!r}")
        return int(want)
    if _kernels.backend() != "cuda":
        return None
    return _sm_count(getattr(mx.default_device(), "index", 0) or 0)


MMA_MAX_WAVES = 8  # waves of threadgroups the split count may take to even out the SMs' work
MMA_SPLIT_COST = 256  # a split's fixed cost (filling the copy ring, merging warps), in tokens


def mma_splits(tokens: int, rows: int, nwarps: int, sm_blocks: int = MMA_SM_BLOCKS) -> int:
    """Splits for the tensor-core kernel, at least :data:`MMA_MIN_SPAN` tokens each (no upper
    bound: its softmax is online).

    Where the device's SM count is known (:func:`sm_count`), the split count is sized to whole
    waves: ``rows x splits`` threadgroups run ``sm_blocks`` per SM at once (the register cap's
    occupancy), and a partly filled last wave costs nearly as much as a full one, so the count
    minimizes the busiest SM's work, ``waves x (tokens per split + MMA_SPLIT_COST)``, over
    split counts that fill 1 to :data:`MMA_MAX_WAVES` waves. ``VELOX_DECODE_BLOCKS`` (or an
    unknown SM count) asks for about that many threadgroups instead (default
    :data:`MMA_BLOCKS`)."""
    rows = max(1, rows)
    most = max(1, tokens // max(MMA_MIN_SPAN, 32 * nwarps))
    target = env_setting("VELOX_DECODE_BLOCKS")
    sms = sm_count() if target is None else None
    if sms is None:
        s = min(max(1, math.ceil(int(target or MMA_BLOCKS) / rows)), most)
    else:
        slots = sms * (sm_blocks if sm_blocks > 0 else max(1, 8 // nwarps))
        counts = {most} | {min(most, w * slots // rows) for w in range(1, MMA_MAX_WAVES + 1)}

        def cost(c: int) -> tuple[int, int]:
            return math.ceil(rows * c / slots) * (math.ceil(tokens / c) + MMA_SPLIT_COST), c

        s = min((c for c in counts if c >= 1), key=cost, default=1)
    return math.ceil(tokens / math.ceil(tokens / s))


def mma_template(
    dim: int,
    keys: Codes,
    values: Codes,
    rows: int,
    nwarps: int,
    stages: int,
    subtiles: int = 1,
    scale: float | None = None,
    query_dtype: mx.Dtype = mx.float32,
    p_residual: bool = True,
    pipeline: bool = False,
    value_fold: bool = False,
    out_dtype: mx.Dtype | None = None,
    fuse_chunk: int = 0,
    key_fold: bool = False,
    ldsm: bool = True,
) -> list[tuple[str, int | mx.Dtype]]:
    """The tensor-core body's compile-time constants (``decode_attention_mma.cu``). An fp16
    or bfloat16 query goes into the MMA as it is (``QLO`` 0: a bfloat16 channel is exact in
    fp16 from ``2^-17`` to 65504, see :data:`MMA_HALF_QUERY`); any other dtype as fp16 hi and
    lo parts.
    ``p_residual``: the softmax weights as fp16 plus their rounding residual (``PLO`` 1), or
    rounded to fp16 (one value MMA instead of two). ``pipeline``: score the next step before
    consuming this one (``PIPE`` 1; it needs at least 3 ring stages and the registers the
    residual would take, so only with ``p_residual`` off). ``value_fold``: fold the value scales
    and zeros into the weights (``VFOLD`` 1, where :func:`mma_fold_ok`): the value codes go into
    the MMA as they are stored, one instruction per pair instead of three. ``key_fold``: fold
    the key scales and zeros out of the score MMA (``KFOLD`` 1, where :func:`mma_key_fold_ok`):
    the key codes likewise go in as stored, and each score is put together from the group
    sums afterwards. ``out_dtype`` given: the last threadgroup of each (batch, head) merges
    the splits into an output of that dtype (``FUSE`` 1, ``OT``; the launch must zero its
    output: ``init_value=0``); ``fuse_chunk`` (tests): that merge takes the splits' weights in
    chunks of at most this many (0: as many as fit in shared memory). ``ldsm``: read the code
    words out of the ring with ldmatrix (``LDSM`` 1): the keys with ``KFOLD`` (four 16-byte
    segments a load), the values with ``VFOLD`` in the 16-bit unit layout where a group holds
    8 units (:func:`mma_value_units`; transposing loads hand each lane two tokens' codes in one
    register, so no byte permute). ``KSBF`` / ``VSBF``: a side's scales and zeros are
    bfloat16 (from ``keys.a`` / ``values.a``; else float16). ``KCB`` / ``VCB``: a side's codes
    index a codebook's levels (``kind`` :data:`CODEBOOK`: one norm a token, no zeros; it needs
    that side's fold and ``ldsm``, which :func:`mma_launch` checks)."""
    return [
        ("HD", dim),
        ("KBITS", keys.bits),
        ("VBITS", values.bits),
        ("KGROUP", keys.group),
        ("VGROUP", values.group),
        ("MROWS", rows),
        ("NWARPS", nwarps),
        ("NSTAGE", stages),
        ("NSUB", subtiles),
        ("QMUL", qmul_bits(scale)),
        ("QLO", 0 if query_dtype in MMA_HALF_QUERY else 1),
        ("PLO", int(p_residual)),
        ("PIPE", int(pipeline and stages >= 3 and not p_residual)),
        ("VFOLD", int(value_fold and mma_fold_ok(values, dim, p_residual, ldsm))),
        ("KFOLD", int(key_fold and mma_key_fold_ok(keys, dim))),
        ("FUSE", int(out_dtype is not None)),
        ("OT", mx.float32 if out_dtype is None else out_dtype),
        ("FCHUNK", int(fuse_chunk)),
        ("LDSM", int(ldsm)),
        ("KSBF", int(keys.a is not None and keys.a.dtype == mx.bfloat16)),
        ("VSBF", int(values.a is not None and values.a.dtype == mx.bfloat16)),
        ("KCB", _codebook_mode(keys)),
        ("VCB", _codebook_mode(values)),
    ]


@dataclass(frozen=True)
class MmaLaunch:
    """How the tensor-core kernel is launched for one call (see :func:`mma_launch`)."""

    spec: KernelSpec
    template: list[tuple[str, int]]
    splits: int
    nwarps: int


# the settings the launch plan reads from the environment (besides the split count's)
_MMA_SETTINGS = (
    "VELOX_DECODE_MMA_WARPS",
    "VELOX_DECODE_SUBTILES",
    "VELOX_DECODE_STAGES",
    "VELOX_DECODE_MMA_SM_BLOCKS",
    "VELOX_DECODE_P_RESIDUAL",
    "VELOX_DECODE_PIPELINE",
    "VELOX_DECODE_VFOLD",
    "VELOX_DECODE_KFOLD",
    "VELOX_DECODE_LDSM",
    "VELOX_DECODE_SYMMETRIC",
)


def mma_launch(
    q_shape: tuple[int, int, int, int],
    query_dtype: mx.Dtype,
    keys: Codes,
    values: Codes,
    splits: int | None = None,
    scale: float | None = None,
    p_residual: bool | None = None,
    pipeline: bool | None = None,
    value_fold: bool | None = None,
    out_dtype: mx.Dtype | None = None,
    key_fold: bool | None = None,
) -> MmaLaunch | None:
    """The tensor-core kernel's launch for a ``(B, H, M, D)`` query over ``keys`` / ``values``
    from the settings (warps, steps of up to four tiles as two ring stages hold them, ring
    stages, register cap, splits; ``p_residual``, ``pipeline``, ``value_fold`` and
    ``key_fold`` default to theirs; ``out_dtype`` given: the kernel merges its splits into an
    output of that dtype), or None where no ring fits in shared memory. Everything but the
    split count is planned once per shape, codes and settings (the environment's values are
    part of the key)."""
    b, h, m, dim = q_shape
    t = keys.codes.shape[2]
    plan = _mma_plan(
        m,
        dim,
        query_dtype,
        (keys.kind, keys.bits, keys.group, keys.a.dtype, keys.symmetric),
        (values.kind, values.bits, values.group, values.a.dtype, values.symmetric),
        scale,
        p_residual,
        pipeline,
        value_fold,
        out_dtype,
        key_fold,
        mma_subnormals_exact(),  # both folds put codes into the MMAs as fp16 subnormals
        tuple(map(env_setting, _MMA_SETTINGS)),
    )
    if plan is None:
        return None
    spec, tmpl, nwarps, sm_blocks = plan
    if splits is None:
        s = mma_splits(t, b * h, nwarps, sm_blocks)
    else:
        s = max(1, min(int(splits), t))
        s = math.ceil(t / math.ceil(t / s))
    return MmaLaunch(spec, list(tmpl), s, nwarps)


@functools.lru_cache(maxsize=512)
def _mma_plan(
    m: int,
    dim: int,
    query_dtype: mx.Dtype,
    kside: tuple[int, int, int, mx.Dtype, bool],
    vside: tuple[int, int, int, mx.Dtype, bool],
    scale: float | None,
    p_residual: bool | None,
    pipeline: bool | None,
    value_fold: bool | None,
    out_dtype: mx.Dtype | None,
    key_fold: bool | None,
    exact: bool,
    settings: tuple[str | None, ...],
) -> tuple[KernelSpec, tuple[tuple[str, int | mx.Dtype], ...], int, int] | None:
    """:func:`mma_launch`'s plan without the splits: (spec, template, warps, threadgroups
    per SM). ``exact``: whether the device takes subnormal MMA operands exactly
    (:func:`mma_subnormals_exact`; both folds need it). ``settings`` (the environment's
    values of :data:`_MMA_SETTINGS`) only keys the cache: the helpers read the same values."""
    keys = Codes(kside[0], kside[1], kside[2], None, _dummy(kside[3]), symmetric=kside[4])
    values = Codes(vside[0], vside[1], vside[2], None, _dummy(vside[3]), symmetric=vside[4])
    nwarps = mma_warps()
    sub = mma_subtiles()
    stages = mma_stages(dim, keys, values, nwarps, sub)
    while stages == 0 and sub > 1:  # fewer tiles a step where two stages do not fit
        sub //= 2
        stages = mma_stages(dim, keys, values, nwarps, sub)
    if stages == 0:
        return None
    sm_blocks = mma_sm_blocks(nwarps)
    tmpl = mma_template(
        dim,
        keys,
        values,
        m,
        nwarps,
        stages,
        sub,
        scale,
        query_dtype,
        mma_p_residual() if p_residual is None else p_residual,
        mma_pipeline() if pipeline is None else pipeline,
        exact and (mma_value_fold() if value_fold is None else value_fold),
        out_dtype,
        key_fold=exact and (mma_key_fold() if key_fold is None else key_fold),
        ldsm=mma_ldsm(),
    )
    tm = dict(tmpl)
    if (tm["KCB"] and not (tm["KFOLD"] and tm["LDSM"])) or (
        tm["VCB"] and not (tm["VFOLD"] and tm["LDSM"])
    ):
        return None  # codebook codes go in only through the folds' ldmatrix layouts
    return mma_spec(nwarps, sm_blocks, out_dtype is None), tuple(tmpl), nwarps, sm_blocks


@dataclass(frozen=True)
class MmaLayout:
    """Where the results of the tensor-core kernel merging its own splits (``FUSE`` 1) lie in
    its one float32 output (offsets and the total in float32 elements, every region whole 16
    bytes): the merged output (in its dtype, from offset 0), its (max, sum) and the
    threadgroup counts, then the partials. Without the merge the partials are the kernel's two
    outputs (:func:`mma_spec` with ``parts``)."""

    b: int
    h: int
    splits: int
    rows: int
    dim: int
    out_dtype: mx.Dtype
    mlo_off: int
    count_off: int
    ml_off: int
    o_off: int
    size: int

    def parts(self, ws: Any) -> tuple[Any, Any, Any, Any, Any]:
        """``(o_part, ml_part, out, mlo, count)``: views of ``ws`` (an MLX array, or the numpy
        array of the CPU emulation, where a bfloat16 ``out`` comes widened to float32)."""
        b, h, s, m, d = self.b, self.h, self.splits, self.rows, self.dim
        o_part = ws[self.o_off : self.o_off + b * h * s * m * d].reshape(b, h, s, m, d)
        ml_part = ws[self.ml_off : self.ml_off + b * h * s * m * 2].reshape(b, h, s, m, 2)
        n = b * h * m * d
        if isinstance(ws, mx.array):
            odt, cdt = self.out_dtype, mx.uint32
        else:  # numpy (the emulation): the same dtype by name; bfloat16 widened to float32
            import numpy as np

            name = str(self.out_dtype).replace("mlx.core.", "")
            odt, cdt = np.dtype("uint16" if name == "bfloat16" else name), np.uint32
        out = ws[: self.mlo_off].view(odt)[:n].reshape(b, h, m, d)
        if not isinstance(ws, mx.array) and self.out_dtype == mx.bfloat16:
            out = (out.astype(np.uint32) << 16).view(np.float32)
        mlo = ws[self.mlo_off : self.mlo_off + b * h * m * 2].reshape(b, h, m, 2)
        count = ws[self.count_off : self.count_off + b * h].view(cdt)
        return o_part, ml_part, out, mlo, count

    def merged(self, ws: mx.array) -> tuple[mx.array, mx.array, mx.array]:
        """``FUSE`` 1: the merged ``(o, m, l)`` as views of the MLX array ``ws`` (``o`` in
        the output dtype, ``m`` and ``l`` ``(B, H, M, 1)``), without the partials' views."""
        b, h, m, d = self.b, self.h, self.rows, self.dim
        n = b * h * m * d
        out = ws[: self.mlo_off].view(self.out_dtype)
        if self.mlo_off * 4 != n * self.out_dtype.size:  # the region's padding to 16 bytes
            out = out[:n]
        mlo = ws[self.mlo_off : self.mlo_off + b * h * m * 2].reshape(b, h, m, 2)
        mm, ll = mx.split(mlo, 2, axis=-1)  # (a third of the Python time of two [..., i:j])
        return out.reshape(b, h, m, d), mm, ll


def _words16(n: int) -> int:
    return (n + 3) // 4 * 4


@functools.lru_cache(maxsize=256)
def mma_layout(b: int, h: int, s: int, m: int, dim: int, out_dtype: mx.Dtype) -> MmaLayout:
    """The output layout (``decode_attention_mma.cu``'s ``ws``) of the tensor-core kernel
    merging its splits (``FUSE`` 1) into an output of ``out_dtype``, for ``b`` x ``h`` KV
    heads, ``s`` splits, ``m`` query rows, head dim ``dim``."""
    if out_dtype is None:
        raise ValueError(
            "mma_layout: the workspace layout is the merging kernel's; without the merge the "
            "partials are the kernel's two outputs (mma_spec(..., parts=True))"
        )
    n_out = _words16((b * h * m * dim * out_dtype.size + 3) // 4)
    n_mlo = _words16(b * h * m * 2)
    n_cnt = _words16(b * h)
    ml = n_out + n_mlo + n_cnt
    o = ml + _words16(b * h * s * m * 2)
    size = o + b * h * s * m * dim
    return MmaLayout(b, h, s, m, dim, out_dtype, n_out, n_out + n_mlo, ml, o, size)


def _plan_mma(
    q_shape: tuple[int, int, int, int],
    q_dtype: mx.Dtype,
    keys: Codes,
    values: Codes,
    splits: int | None,
    scale: float | None,
    out_dtype: mx.Dtype | None = None,
):
    """The tensor-core kernel's launch for a fixed query shape, as ``run(q)``, or None where
    no ring fits. ``run`` returns the per-split partials and the query it took; with
    ``out_dtype`` the kernel merges its splits itself and ``run`` returns the merged
    ``(o, m, l)`` (``o`` normalized, in ``out_dtype``)."""
    launch = mma_launch(q_shape, q_dtype, keys, values, splits, scale, out_dtype=out_dtype)
    if launch is None:
        return None
    b, h, m, dim = q_shape
    s, nt = launch.splits, launch.nwarps * 32
    kc, ka, kb, kl = mma_inputs(keys)
    vc, va, vb, vl = mma_inputs(values)
    rest = [kc, ka, kb, vc, va, vb, kl, vl]
    kernel, tmpl = launch.spec.kernel(), launch.template
    grid, tg = (s * nt, b * h, 1), (nt, 1, 1)
    if out_dtype is None:  # the partials as the kernel's two outputs (DECODE_MMA_PARTS)
        shapes = [(b, h, s, m, 2), (b, h, s, m, dim)]

        def run_parts(q):
            ml_part, o_part = kernel(
                inputs=[q, *rest],
                template=tmpl,
                grid=grid,
                threadgroup=tg,
                output_shapes=shapes,
                output_dtypes=[mx.float32, mx.float32],
            )
            return o_part, ml_part, q

        return run_parts
    lay = mma_layout(b, h, s, m, dim, out_dtype)
    size = [(lay.size,)]

    def run_fused(q):
        (ws,) = kernel(
            inputs=[q, *rest],
            template=tmpl,
            grid=grid,
            threadgroup=tg,
            output_shapes=size,
            output_dtypes=[mx.float32],
            init_value=0,
        )
        return lay.merged(ws)

    return run_fused


def _decode_mma(
    q: mx.array,
    keys: Codes,
    values: Codes,
    splits: int | None,
    scale: float | None,
    out_dtype: mx.Dtype | None = None,
) -> tuple[mx.array, mx.array, mx.array] | None:
    """The tensor-core kernel's per-split partials and the query it took, or None. With
    ``out_dtype``: the kernel merges its splits itself and this returns the merged
    ``(o, m, l)`` (``o`` normalized, in ``out_dtype``)."""
    run = _plan_mma(q.shape, q.dtype, keys, values, splits, scale, out_dtype)
    return None if run is None else run(q)


def mma_inputs(c: Codes) -> tuple[mx.array, mx.array, mx.array, mx.array]:
    """One side's inputs of the tensor-core kernel (``kc, ka, kb`` or ``vc, va, vb``, then
    ``kl`` or ``vl``): codes, scales, zeros and levels. A codebook
    side has no zeros: its norms stand in for them (the kernel copies the plane but never
    reads it), and its levels are float32; an affine side's levels are a dummy."""
    if c.kind == CODEBOOK:
        lev = c.levels if c.levels.dtype == mx.float32 else c.levels.astype(mx.float32)
        return c.codes, c.a, c.a, lev
    return c.codes, c.a, c.b, _dummy(mx.float32)


def _plan_portable(
    q_shape: tuple[int, int, int, int],
    keys: Codes,
    values: Codes,
    splits: int | None,
    scale: float | None,
):
    """The portable kernel's launch for a fixed query shape, as ``run(q, q_sketch)``
    returning the per-split partials (query rows padded to its row blocks) and the padded
    query it took, or None where it has no layout for the shape."""
    b, h, m, dim = q_shape
    t = keys.codes.shape[2]
    p = plan_for(m, dim, keys, values)
    if p is None:
        return None
    if keys.sketch is not None and keys.sketch.lanes != p.klanes:
        raise ValueError(
            f"decode_attention: the sketch matrix is laid out for {keys.sketch.lanes} lanes, "
            f"the plan takes {p.klanes} (sketch_lanes at call time)"
        )
    _check("key", keys, b, h, t, dim)
    _check("value", values, b, h, t, dim)
    mp = p.nmb * p.mb
    s = choose_splits(t, b * h, p) if splits is None else fit_splits(t, splits, p)
    s = block_splits(t, s, p, keys)
    nt = p.nwarps * 32
    kernel, tmpl = DECODE.kernel(), template(p, dim, keys, values, scale)
    codes = [*_inputs(keys), *_inputs(values)]
    grid, tg = (s * nt, b * h, p.nmb), (nt, 1, 1)
    shapes = [(b, h, s, mp, dim), (b, h, s, mp, 2)]
    plain = keys.sketch is None and keys.signs is None
    extra = _sketch_inputs(keys, None, mp) if plain else None

    def run(q, q_sketch=None):
        qf = q if scale is not None else q.astype(mx.float32)  # unscaled: the kernel scales it
        qf = _pad_rows(qf, mp)
        more = extra if plain else _sketch_inputs(keys, q_sketch, mp)
        o_part, ml_part = kernel(
            inputs=[qf, *codes, *more],
            template=tmpl,
            grid=grid,
            threadgroup=tg,
            output_shapes=shapes,
            output_dtypes=[mx.float32, mx.float32],
        )
        return o_part, ml_part, qf

    return run


def _decode_portable(
    q: mx.array,
    keys: Codes,
    values: Codes,
    splits: int | None,
    scale: float | None,
    q_sketch: mx.array | None = None,
) -> tuple[mx.array, mx.array, mx.array] | None:
    """The portable kernel's per-split partials (query rows padded to its row blocks) and
    the padded query it took, or None where it has no layout for the shape."""
    run = _plan_portable(q.shape, keys, values, splits, scale)
    return None if run is None else run(q, q_sketch)


def _pad_rows(x: mx.array, rows: int) -> mx.array:
    """``x (B, H, R, D)`` with zero rows appended up to ``rows``."""
    b, h, r, d = x.shape
    return x if rows <= r else mx.concatenate([x, mx.zeros((b, h, rows - r, d), x.dtype)], axis=2)


def merge_splits(o_part: mx.array, ml_part: mx.array) -> tuple[mx.array, mx.array, mx.array]:
    """One partial from the per-split partials of a decode kernel (the merge kernel).

    Shapes:
        ``o_part (B, H, S, R, D)``, ``ml_part (B, H, S, R, 2)`` (max and sum in log2 units);
        returns ``o (B, H, R, D)``, ``m`` and ``l`` ``(B, H, R, 1)``, float32, ``m`` in
        natural-log units.
    """
    b, h, _, rows, dim = o_part.shape
    grid, tg = merge_launch(b * h * rows, dim)
    o, mm, ll = MERGE.kernel()(
        inputs=[o_part, ml_part],
        grid=grid,
        threadgroup=tg,
        output_shapes=[(b, h, rows, dim), (b, h, rows, 1), (b, h, rows, 1)],
        output_dtypes=[mx.float32, mx.float32, mx.float32],
    )
    return o, mm, ll


def merge_splits_fp16(
    o_part: mx.array,
    ml_part: mx.array,
    q: mx.array,
    fp16: list[tuple[mx.array, mx.array]],
    out_dtype: mx.Dtype,
    scale: float | None = None,
    rot: mx.array | None = None,
) -> tuple[mx.array, mx.array, mx.array]:
    """The normalized attention over a decode kernel's splits and up to two fp16 segments, in
    one launch (``metal/decode_merge_fp16.metal``).

    Args:
        o_part, ml_part: the decode kernel's per-split partials.
        q: the queries the decode kernel took, ``(B, H, R, D)``: float32 with the attention
            scale applied, or (with ``scale``) unscaled in any float dtype.
        fp16: up to two ``(keys, values)`` pairs ``(B, H, T_i, D)`` (any float dtype,
            ``sum T_i <= FP16_MAX``), e.g. a cache's sinks and recent window.
        out_dtype: dtype of the output.
        scale: the attention scale, when ``q`` comes without it.
        rot: ``(D, D)`` float32: the partials are in a rotated domain and ``o @ rot`` maps
            them back (TurboQuant); ``q`` is then the unrotated query.

    Shapes:
        returns ``o (B, H, R, D)`` in ``out_dtype`` (softmax-weighted values), ``m`` and ``l``
        ``(B, H, R, 1)`` float32.
    """
    if len(fp16) > 2 or sum(k.shape[2] for k, _ in fp16) > FP16_MAX:
        raise ValueError(f"merge_splits_fp16 takes up to 2 fp16 segments, {FP16_MAX} tokens")
    b, h, _, rows, dim = o_part.shape
    if rot is not None and (rot.shape != (dim, dim) or rot.dtype != mx.float32):
        raise ValueError(
            f"merge_splits_fp16: rot must be float32 ({dim}, {dim}), got {rot.dtype} "
            f"{tuple(rot.shape)}"
        )
    segs = [(k, v) for k, v in fp16 if k.shape[2] > 0]
    dummy = _dummy(mx.float16)
    ak, av = segs[0] if segs else (dummy, dummy)
    bk, bv = segs[1] if len(segs) > 1 else (dummy, dummy)
    grid, tg = merge_launch(b * h * rows, dim)
    o, mm, ll = MERGE_FP16.kernel()(
        inputs=[o_part, ml_part, q, ak, av, bk, bv, _dummy(mx.float32) if rot is None else rot],
        template=[
            ("HAS_A", int(len(segs) > 0)),
            ("HAS_B", int(len(segs) > 1)),
            ("FMAX", FP16_MAX),
            ("QMUL", qmul_bits(scale)),
            ("RD", 1 if rot is None else dim),
        ],
        grid=grid,
        threadgroup=tg,
        output_shapes=[(b, h, rows, dim), (b, h, rows, 1), (b, h, rows, 1)],
        output_dtypes=[out_dtype, mx.float32, mx.float32],
    )
    return o, mm, ll


def _plan_merge_fp16(b: int, h: int, rows: int, dim: int, out_dtype, scale, rot):
    """:func:`merge_splits_fp16` for fixed shapes, as ``run(o_part, ml_part, q, fp16)``: its
    template (per number of non-empty fp16 segments) and launch worked out once."""
    if rot is not None and (rot.shape != (dim, dim) or rot.dtype != mx.float32):
        raise ValueError(
            f"merge_splits_fp16: rot must be float32 ({dim}, {dim}), got {rot.dtype} "
            f"{tuple(rot.shape)}"
        )
    kernel = MERGE_FP16.kernel()
    grid, tg = merge_launch(b * h * rows, dim)
    common = [("FMAX", FP16_MAX), ("QMUL", qmul_bits(scale)), ("RD", 1 if rot is None else dim)]
    templates = [[("HAS_A", int(n > 0)), ("HAS_B", int(n > 1)), *common] for n in range(3)]
    dummy = _dummy(mx.float16)
    last = _dummy(mx.float32) if rot is None else rot
    shapes = [(b, h, rows, dim), (b, h, rows, 1), (b, h, rows, 1)]
    dtypes = [out_dtype, mx.float32, mx.float32]

    def run(o_part, ml_part, q, fp16):
        segs = [(k, v) for k, v in fp16 if k.shape[2] > 0]
        ak, av = segs[0] if segs else (dummy, dummy)
        bk, bv = segs[1] if len(segs) > 1 else (dummy, dummy)
        return kernel(
            inputs=[o_part, ml_part, q, ak, av, bk, bv, last],
            template=templates[len(segs)],
            grid=grid,
            threadgroup=tg,
            output_shapes=shapes,
            output_dtypes=dtypes,
        )

    return run


def _check_call(
    q_shape, keys: Codes, values: Codes, fp16_tokens, out_dtype, merge_q, rot, q_sketch
) -> None:
    """The argument checks of :func:`decode_attention` that do not depend on array values."""
    if (fp16_tokens is not None) != (out_dtype is not None):
        raise ValueError("decode_attention: fp16 segments and out_dtype go together")
    if (rot is not None and not merge_q) or (merge_q and fp16_tokens is None):
        raise ValueError("decode_attention: rot needs merge_q, and merge_q fp16 segments")
    if q_sketch != (keys.signs is not None or keys.sketch is not None):
        raise ValueError(
            "decode_attention: q_sketch goes with keys that carry signs or a sketch (SKETCH)"
        )
    if keys.sketch is not None and keys.kind != SKETCH:
        raise ValueError("decode_attention: a SketchKeys record goes with SKETCH keys")
    if values.kind == SKETCH:
        raise ValueError("decode_attention: sketch codes are for keys only")


def plan_decode(
    q_shape: tuple[int, int, int, int],
    q_dtype: mx.Dtype,
    keys: Codes,
    values: Codes,
    splits: int | None = None,
    fp16_tokens: int | None = None,
    out_dtype: mx.Dtype | None = None,
    scale: float | None = None,
    merge_q: bool = False,
    rot: mx.array | None = None,
    q_sketch: bool = False,
):
    """:func:`decode_attention` planned once for one coded segment and one query shape.

    The checks, the kernel's layout, template, splits and grid (and the merge's) are worked
    out here; the returned ``run(q, fp16=None, merge_q=None, q_sketch=None)`` only launches
    the kernels, so a decode step reuses it while the segment is unchanged (a cache passes
    tokens to its codes ``flush`` at a time). ``run`` returns what :func:`decode_attention`
    returns, or None where the fp16 segments it is given exceed :data:`FP16_MAX` tokens.
    Returns None where no kernel takes the shape.

    Args:
        q_shape, q_dtype: the queries ``run`` takes (see :func:`decode_attention`).
        fp16_tokens: with ``out_dtype``: the fp16 tokens of the segments ``run`` will join
            (0 lets the tensor-core kernel merge its own splits where it can; ``run`` must
            then be given none).
        merge_q, q_sketch: whether ``run`` is given these queries.
        Others: as :func:`decode_attention`.
    """
    b, h, m, dim = q_shape
    t = keys.codes.shape[2]
    if t < 1 or values.codes.shape[2] != t:
        return None
    _check_call(q_shape, keys, values, fp16_tokens, out_dtype, merge_q, rot, q_sketch)
    if fp16_tokens is not None and fp16_tokens > FP16_MAX:
        return None
    parts = None
    if keys.sketch is not None and keys.sketch.mma:  # QJL keys laid out for the tensor cores
        from .sketch_mma import decode_sketch_mma, supported

        if not supported(m, dim, keys, values):
            raise ValueError(
                "decode_attention: the sketch keys are laid out for the tensor-core sketch "
                "kernel (SketchKeys.mma), which does not take this segment (sketch_mma.supported)"
            )

        def parts(q, qs):
            return decode_sketch_mma(q, keys, values, splits, scale, qs)

    elif _kernels.backend() == "cuda" and mma_enabled() and mma_supported(m, dim, keys, values):
        _check("key", keys, b, h, t, dim)
        _check("value", values, b, h, t, dim)
        if fp16_tokens == 0 and rot is None and mma_fuse_merge(t):
            # no fp16 tokens to join: the kernel merges its own splits (one launch)
            fused = _plan_mma(q_shape, q_dtype, keys, values, splits, scale, out_dtype)
            if fused is not None:

                def run_fused(q, fp16=None, merge_q=None, q_sketch=None):
                    if fp16 and any(k.shape[2] for k, _ in fp16):
                        raise ValueError("decode_attention: planned without fp16 tokens")
                    return fused(q)

                return run_fused
        else:
            mma = _plan_mma(q_shape, q_dtype, keys, values, splits, scale)
            if mma is not None:

                def parts(q, qs):
                    return mma(q)

    if parts is None:
        portable = _plan_portable(q_shape, keys, values, splits, scale)
        if portable is None:
            return None
        parts = portable
    want_qs = q_shape if keys.sketch is None else (b, h, m, keys.sketch.m)
    merges: dict[int, Any] = {}  # the merge, per query rows the decode kernel took

    def run(q, fp16=None, merge_q=None, q_sketch=None):
        if q_sketch is not None and tuple(q_sketch.shape) != tuple(want_qs):
            raise ValueError(
                f"decode_attention: q_sketch {tuple(q_sketch.shape)} must be {tuple(want_qs)}"
            )
        if fp16 is not None and (len(fp16) > 2 or sum(k.shape[2] for k, _ in fp16) > FP16_MAX):
            return None
        o_part, ml_part, qk = parts(q, q_sketch)  # qk: the query the kernel took (rows padded)
        rows = o_part.shape[3]
        if out_dtype is not None:
            merge = merges.get(rows)
            if merge is None:
                merge = merges[rows] = _plan_merge_fp16(b, h, rows, dim, out_dtype, scale, rot)
            mq = qk if merge_q is None else _pad_rows(merge_q, rows)
            o, mm, ll = merge(o_part, ml_part, mq, fp16 or [])
        else:
            o, mm, ll = merge_splits(o_part, ml_part)
        if rows > m:
            o, mm, ll = o[:, :, :m], mm[:, :, :m], ll[:, :, :m]
        return o, mm, ll

    return run


def decode_attention(
    q: mx.array,
    keys: Codes,
    values: Codes,
    splits: int | None = None,
    fp16: list[tuple[mx.array, mx.array]] | None = None,
    out_dtype: mx.Dtype | None = None,
    scale: float | None = None,
    merge_q: mx.array | None = None,
    rot: mx.array | None = None,
    q_sketch: mx.array | None = None,
) -> tuple[mx.array, mx.array, mx.array] | None:
    """Partial attention ``(o, m, l)`` of ``q`` over one coded segment, or None if unsupported.

    Args:
        q: ``(B, H, M, D)`` grouped queries, float32, scale applied; or, with ``scale``, the
            unscaled queries in any float dtype (the kernels apply the scale themselves,
            saving the cast and the multiply).
        keys, values: the segment's codes (see :class:`Codes`); same head dim as ``q``.
        splits: number of context chunks (default :func:`choose_splits`).
        fp16: with ``out_dtype``: up to two fp16 segments ``(keys, values)`` joined in the same
            softmax by the merge (:func:`merge_splits_fp16`); ``o`` is then the normalized
            attention over all of them, in ``out_dtype``.
        out_dtype: see ``fp16``.
        scale: the attention scale, when ``q`` comes without it.
        merge_q, rot: with ``fp16``, for codes in a rotated domain (TurboQuant): ``q`` is the
            rotated query, ``merge_q`` the unrotated one (scored against the fp16 keys) and
            ``rot`` the ``(D, D)`` float32 map back (``o @ rot``, see
            :func:`merge_splits_fp16`). ``merge_q`` alone: keys coded in another domain than
            the fp16 keys, values in the same one (VecInfer's transformed keys).
        q_sketch: with keys that carry a residual sketch (``keys.signs``): the sketched query
            ``(B, H, M, D)`` (times the sketch's constant), scaled like ``q``; with
            :data:`SKETCH` keys: ``S q`` ``(B, H, M, m)`` float32 (no constant), from the same
            ``q`` as the kernel takes (scaled or not).

    One call of :func:`plan_decode`'s plan; a caller attending the same segment again
    (a decode step) keeps the plan instead.

    Shapes:
        returns ``o (B, H, M, D)``, ``m (B, H, M, 1)``, ``l (B, H, M, 1)``, float32 (``o`` in
        ``out_dtype`` and normalized when ``out_dtype`` is given).
    """
    if fp16 is not None and len(fp16) > 2:
        return None
    if merge_q is not None and merge_q.shape != q.shape:
        raise ValueError(
            f"decode_attention: merge_q {tuple(merge_q.shape)} must match q {tuple(q.shape)}"
        )
    fp16_tokens = None if fp16 is None else sum(k.shape[2] for k, _ in fp16)
    run = plan_decode(
        q.shape,
        q.dtype,
        keys,
        values,
        splits,
        fp16_tokens,
        out_dtype,
        scale,
        merge_q is not None,
        rot,
        q_sketch is not None,
    )
    return None if run is None else run(q, fp16, merge_q, q_sketch)
