"""Which segments the tensor-core decode kernel takes, and its settings.

:func:`mma_supported` is the layout test; the ``mma_*`` functions are the kernel's settings
(warps, register cap, tiles per step, ring stages, splits, the scale folds, ldmatrix, merging
in the kernel), each with its default; :func:`mma_subnormals_exact` runs a one-off probe of
the device's fp16 subnormal MMA operands, which the folds rely on.
"""

from __future__ import annotations

import ctypes
import functools
import math
from typing import Any

import mlx.core as mx

from .. import kernels as _kernels  # backend() looked up per call (tests report another)
from .build import KernelSpec
from .config import kernel_config
from .records import AFFINE, AFFINE_CHANNEL, CODEBOOK, CodeRecord

__all__ = ["MMA_SCALE_DTYPES", "mma_enabled", "mma_splits", "mma_supported"]

# one MMA on subnormal codes: whether the tensor cores take them exactly (the folds rely on it)
PROBE_SUBNORMAL = KernelSpec(
    name="velox_probe_subnormal_mma",
    source="probe_subnormal_mma.cu",
    inputs=("salt_in",),
    outputs=("out",),
    cuda_headers=("velox_mma.cuh",),
)

MMA_BITS = (2, 4, 8)

MMA_MAX_ROWS = 8  # query rows per KV head the tensor-core kernel holds (rows 0-7 of a tile)

MMA_MIN_SPAN = 512  # fewest tokens per split of the tensor-core kernel

MMA_BLOCKS = 512  # threadgroups the tensor-core kernel aims for (measured on an H200)


def mma_enabled() -> bool:
    """The tensor-core kernel is used on CUDA unless ``KernelConfig.mma`` 0."""
    return kernel_config().mma


# scale and zero dtypes the tensor-core kernel reads (KSBF / VSBF pick bfloat16 per side)
MMA_SCALE_DTYPES = (mx.float16, mx.bfloat16)

# query dtypes that go into the score MMA as they are (QLO = 0), converted to fp16: exact for
# fp16, and for bfloat16 channels of magnitude 2^-17 to 65504 (8 significant bits within fp16's
# 11 and its subnormal spacing 2^-24; with the key fold's factor 2^-o, from 2^(o - 17)); smaller
# ones round to 2^-25 absolute (QLO = 1 would only add a second MMA of near-zero lo parts)
MMA_HALF_QUERY = (mx.float16, mx.bfloat16)

# codebook code widths the tensor-core kernel looks up in registers (KCB / VCB)
MMA_CODEBOOK_BITS = (2, 4)


def _mma_codebook_side(c: CodeRecord, dim: int, key: bool) -> bool:
    """A codebook side (one norm a token, ``2**bits`` levels, no residual
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
    (:attr:`CodebookCodes.symmetric`; ``KCB`` / ``VCB`` 2): ``KernelConfig.symmetric`` (default 1;
    0 looks every codebook up as general levels, for comparison)."""
    return kernel_config().symmetric


def codebook_mode(c: CodeRecord) -> int:
    """``KCB`` / ``VCB``: 0 affine, 1 codebook, 2 a codebook the caller vouches is symmetric
    (:attr:`CodebookCodes.symmetric`: 4 bits in half the table, 2 bits without permutes) while
    :func:`mma_symmetric` allows it."""
    if c.kind != CODEBOOK:
        return 0
    return 2 if c.symmetric and mma_symmetric() else 1


def _mma_side(c: CodeRecord, dim: int, lane_channels: int) -> bool:
    if c.kind != AFFINE or c.bits not in MMA_BITS or dim % c.group:
        return False
    if (lane_channels * c.bits) % 32 or c.group % (32 // c.bits):
        return False
    if c.a.dtype not in MMA_SCALE_DTYPES or c.b is None or c.b.dtype != c.a.dtype:
        return False
    return lane_channels % c.group == 0 or c.group % lane_channels == 0


def _mma_channel_side(c: CodeRecord, dim: int) -> bool:
    """Per-channel affine keys (KIVI's, ``KCH``): 2, 4 or 8 bits whose quarter of a row fills
    whole code words, groups of whole 16-token tiles (a multiple of 16 tokens), a context of
    whole groups, and fp16 or bf16 scale and zero rows ``(B, H, T / group, D)`` of one dtype."""
    if c.bits not in MMA_BITS or c.group < 16 or c.group % 16 or (dim // 4 * c.bits) % 32:
        return False
    if c.a is None or c.b is None or c.a.dtype not in MMA_SCALE_DTYPES or c.b.dtype != c.a.dtype:
        return False
    if c.codes.ndim != 4 or c.signs is not None or c.levels is not None:
        return False
    b, h, t, _ = c.codes.shape
    rows = (b, h, t // c.group, dim)
    return t % c.group == 0 and tuple(c.a.shape) == rows and tuple(c.b.shape) == rows


def mma_key_rows(tile: int, group: int) -> int:
    """Key scale (and zero) rows of per-channel keys a loop step of ``tile`` tokens meets, as
    the kernel's ring stage holds them (``KCR``; steps start at multiples of ``tile``, groups
    of ``group`` tokens, both multiples of 16): one where a group holds whole steps, the
    step's groups where whole groups fill it, else at most ``(tile - 16) // group + 2``."""
    if group % tile == 0:
        return 1
    if tile % group == 0:
        return tile // group
    return min(tile // 16, (tile - 16) // group + 2)


def mma_supported(m: int, dim: int, keys: CodeRecord, values: CodeRecord) -> bool:
    """Whether ``decode_attention_mma.cu`` lays out this shape: affine codes of 2, 4 or 8 bits
    with float16 or bfloat16 scales and zeros (one dtype a side) on both sides, at most
    :data:`MMA_MAX_ROWS` query rows, a head dim that is a multiple of 16 whose quarter (keys)
    and eighth (values) fill whole code words, and groups that hold whole code words and whole
    lanes (or lanes whole groups); or codebook codes of 2 or 4 bits with one fp16 or bf16 norm
    a token (rotated-domain codebooks, :func:`_mma_codebook_side`) on either side; or
    per-channel affine keys (KIVI's, :func:`_mma_channel_side`)."""
    if not 1 <= m <= MMA_MAX_ROWS or dim % 16:
        return False
    if keys.kind == CODEBOOK:
        kok = _mma_codebook_side(keys, dim, True)
    elif keys.kind == AFFINE_CHANNEL:
        kok = _mma_channel_side(keys, dim)
    else:
        kok = _mma_side(keys, dim, dim // 4)
    vok = (
        _mma_codebook_side(values, dim, False)
        if values.kind == CODEBOOK
        else _mma_side(values, dim, dim // 8)
    )
    return kok and vok


# static shared memory of one threadgroup (the rest of 48 KiB: row stats and mbarriers)
MMA_SMEM = 48 * 1024 - 1024


def mma_warps() -> int:
    """Warps per threadgroup of the tensor-core kernel: ``KernelConfig.mma_warps``."""
    return kernel_config().mma_warps


MMA_SM_BLOCKS = 3  # threadgroups per SM the register cap aims for (KernelConfig.mma_sm_blocks)


def mma_sm_blocks(nwarps: int) -> int:
    """Threadgroups of ``nwarps`` warps per SM that the tensor-core kernel's register cap
    (``__launch_bounds__``) allows: ``KernelConfig.mma_sm_blocks``, else
    :data:`MMA_SM_BLOCKS` x 4 warps' worth of threadgroups (12 warps per SM, 168 registers,
    for steps of one or two tiles alike: with the scores transposed both fit); 0 leaves the
    registers to the compiler."""
    n = kernel_config().mma_sm_blocks
    return MMA_SM_BLOCKS * 4 // nwarps if n is None else n


def mma_p_residual() -> bool:
    """Whether the tensor-core kernel carries the softmax weights' fp16 rounding residual (a
    second value MMA): ``KernelConfig.p_residual`` (default 0: the weights rounded to fp16, as
    flash attention does; about 2^-11 relative per weight)."""
    return kernel_config().p_residual


def mma_pipeline() -> bool:
    """Whether the tensor-core kernel scores the next step before consuming the current one
    (a software pipeline; it needs at least 3 ring stages and applies without the weights'
    residual, see :func:`mma_template`): ``KernelConfig.pipeline`` (default 1; with steps of
    two tiles, on and off measured within the run-to-run spread on an H200, see
    docs/performance.md)."""
    return kernel_config().pipeline


def mma_value_fold() -> bool:
    """Whether the tensor-core kernel folds the value scales into the softmax weights where
    the layout allows it (see :func:`mma_fold_ok`): ``KernelConfig.value_fold`` (default 1)."""
    return kernel_config().value_fold


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
    where the layout allows it (see :func:`mma_key_fold_ok`): ``KernelConfig.key_fold``
    (default 1)."""
    return kernel_config().key_fold


def mma_key_fold_ok(keys: CodeRecord, dim: int) -> bool:
    """Whether the key scales and zeros can be folded out of the score MMA (``KFOLD``): a
    group holds 4 whole code words (the four lanes of a k-step read adjacent words: 64
    channels or more at 2 bits, 32 at 4, 16 at 8) and a token has at most
    :data:`MMA_KEY_FOLD_GROUPS` groups (one accumulator chain each). Per-channel keys fold
    their scales into the query instead (``KCH``)."""
    if keys.kind == AFFINE_CHANNEL:
        return False
    return keys.group % (4 * (32 // keys.bits)) == 0 and dim // keys.group <= MMA_KEY_FOLD_GROUPS


MMA_FUSE_TOKENS = 16384  # the longest context whose splits the decode kernel merges itself


def mma_fuse_merge(tokens: int) -> bool:
    """Whether the tensor-core kernel merges its splits itself where the call has no fp16
    segments: ``KernelConfig.fuse`` 1 or 0, else up to :data:`MMA_FUSE_TOKENS` tokens.

    Merging in the kernel saves a launch (about 22 µs of host time a call on the H200's host,
    ``gpu_dispatch.py``), but its counters need a zeroed output, and MLX zeroes the whole
    output, partials included, with a fill launch whose device time grows with them (about 5
    µs for 49 splits at batch 1, 128k) while the last threadgroup's merge runs alone at the
    end; a separate merge launch took 4 µs. So short contexts, where a call's host time is
    its cost, merge in the kernel, and long ones in a second launch (batch 1, 128k, 2 bits:
    43.6 µs against 49.5 of device time, docs/performance.md)."""
    fuse = kernel_config().fuse
    return tokens <= MMA_FUSE_TOKENS if fuse is None else fuse


def mma_value_units(values: CodeRecord, ldsm: bool) -> int:
    """Channels per unit of the lanes' interleaved values with ``VFOLD`` (lane g takes units
    g, 8 + g, ... of a row; an m-tile's 16 channels lie in 8 adjacent units): 16-bit units
    (``ldsm``, the ``VLD`` layout, read by transposing ldmatrix loads) where a group holds 8
    of them; else words at 4 and 8 bits, bytes at 2 bits."""
    units = 16 // values.bits
    if ldsm and values.group % (8 * units) == 0:
        return units
    return 8 // values.bits if values.bits == 2 else 32 // values.bits


def mma_fold_ok(values: CodeRecord, dim: int, p_residual: bool, ldsm: bool = True) -> bool:
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
    ``KernelConfig.ldsm`` (default 1)."""
    return kernel_config().ldsm


def mma_subtiles() -> int:
    """16-token MMA tiles per loop step of the tensor-core kernel, at most:
    ``KernelConfig.subtiles`` (the plan halves it until two ring stages fit: at four warps,
    4 for 2-bit keys and values, 2 for 4-bit and mixed 2/4-bit codes, 1 for 8-bit ones)."""
    return kernel_config().subtiles


def mma_stages(
    dim: int,
    keys: CodeRecord,
    values: CodeRecord,
    nwarps: int,
    subtiles: int = 1,
    query_lo: bool = True,
) -> int:
    """Steps (of ``16 * subtiles`` tokens) in each warp's shared-memory ring:
    ``KernelConfig.stages`` or the most (up to 4) that fit in 48 KiB of static shared
    memory; 0 if not even 2 fit. Per-channel keys hold :func:`mma_key_rows` rows of ``dim``
    scales and zeros a step, and the query fragments beside the ring (``dim / 16`` k-steps of
    2 words a lane, 4 with ``query_lo``: the query's fp16 residual, ``QLO``)."""
    tile = 16 * subtiles
    words = tile * dim * (keys.bits + values.bits) // 32
    budget = MMA_SMEM
    if keys.kind == AFFINE_CHANNEL:
        words += mma_key_rows(tile, keys.group) * dim
        budget -= 4 * 32 * (dim // 16) * (4 if query_lo else 2)
    else:
        words += 2 * (-(-tile * (dim // keys.group) // 2))
    words += 2 * (-(-tile * (dim // values.group) // 2))
    if nwarps * 8 * dim * 4 > MMA_SMEM:
        return 0
    fit = [n for n in (4, 3, 2) if nwarps * n * words * 4 <= budget]
    n = kernel_config().stages
    if n is not None:
        return n if nwarps * n * words * 4 <= budget else 0
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
    """Streaming multiprocessors of the CUDA device MLX computes on (``KernelConfig.sms``, else
    the CUDA driver's count), or None where neither is known."""
    want = kernel_config().sms
    if want is not None:
        return want
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
    split counts that fill 1 to :data:`MMA_MAX_WAVES` waves. ``KernelConfig.blocks`` (or an
    unknown SM count) asks for about that many threadgroups instead (default
    :data:`MMA_BLOCKS`)."""
    rows = max(1, rows)
    most = max(1, tokens // max(MMA_MIN_SPAN, 32 * nwarps))
    target = kernel_config().blocks
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
