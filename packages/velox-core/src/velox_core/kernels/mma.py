"""The tensor-core decode kernel (CUDA, ``metal/decode_attention_mma.cu`` bodies): which
segments it takes, its splits, input layout and launch.

:func:`mma_supported` is the layout test; :func:`mma_launch` plans a call (the variant of
:func:`velox_core.kernels.mma_support.mma_kernel_plan`, and the splits: :func:`mma_splits`,
sized to the device's SMs) and :func:`plan_mma` returns the launch that :mod:`.decode` runs.
A decode plan made from a cache passes the configuration it was made under (``settings``);
other callers leave it to be read.
"""

from __future__ import annotations

import ctypes
import functools
import math
from dataclasses import dataclass

import mlx.core as mx

from .. import kernels as _kernels  # backend() looked up per call (tests report another)
from .build import KernelSpec
from .config import KernelConfig, kernel_config
from .disk_cache import CachedKernel
from .layout import unused_input
from .mma_support import (
    MMA_SM_BLOCKS,
    mma_kernel_plan,
    run_subnormal_probe,
    subnormal_probe_ahead,
)
from .records import AFFINE, AFFINE_CHANNEL, CODEBOOK, CodeRecord

__all__ = ["MMA_SCALE_DTYPES", "mma_launch", "mma_splits", "mma_supported", "plan_mma"]

MMA_BITS = (2, 4, 8)


MMA_MAX_ROWS = 8  # query rows per KV head the tensor-core kernel holds (rows 0-7 of a tile)


MMA_MIN_SPAN = 512  # fewest tokens per split of the tensor-core kernel


MMA_BLOCKS = 512  # threadgroups the tensor-core kernel aims for (measured on an H200)


# scale and zero dtypes the tensor-core kernel reads (KSBF / VSBF pick bfloat16 per side)
MMA_SCALE_DTYPES = (mx.float16, mx.bfloat16)


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


MMA_FUSE_TOKENS = 16384  # the longest context whose splits the decode kernel merges itself


def mma_fuse_merge(tokens: int, settings: KernelConfig | None = None) -> bool:
    """Whether the tensor-core kernel merges its splits itself where the call has no fp16
    segments: ``KernelConfig.fuse`` 1 or 0 (of ``settings``, default the configuration in
    force), else up to :data:`MMA_FUSE_TOKENS` tokens.

    Merging in the kernel saves a launch (about 22 µs of host time a call on the H200's host,
    ``gpu_dispatch.py``), but its counters need a zeroed output, and MLX zeroes the whole
    output, partials included, with a fill launch whose device time grows with them (about 5
    µs for 49 splits at batch 1, 128k) while the last threadgroup's merge runs alone at the
    end; a separate merge launch took 4 µs. So short contexts, where a call's host time is
    its cost, merge in the kernel, and long ones in a second launch (batch 1, 128k, 2 bits:
    43.6 µs against 49.5 of device time, docs/performance.md)."""
    fuse = (settings or kernel_config()).fuse
    return tokens <= MMA_FUSE_TOKENS if fuse is None else fuse


_SUBNORMALS: dict[int, bool] = {}


def _cuda_ordinal() -> int | None:
    """The CUDA device MLX computes on, or None where none does (as
    :func:`mma_subnormals_exact` finds it, inline there: a decode plan's path)."""
    if not (hasattr(mx, "cuda") and mx.cuda.is_available()):
        return None
    dev = mx.default_device()
    return None if dev.type != mx.DeviceType.gpu else getattr(dev, "index", 0) or 0


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


def probe_ahead() -> None:
    """Start compiling the probe of :func:`mma_subnormals_exact` in the background where the
    CUDA device's answer is not known yet (the first tensor-core plan runs it)."""
    ordinal = _cuda_ordinal()
    if ordinal is not None and ordinal not in _SUBNORMALS:
        subnormal_probe_ahead()


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


def sm_count(settings: KernelConfig | None = None) -> int | None:
    """Streaming multiprocessors of the CUDA device MLX computes on (``KernelConfig.sms`` of
    ``settings``, default the configuration in force; else the CUDA driver's count), or None
    where neither is known."""
    want = (settings or kernel_config()).sms
    if want is not None:
        return want
    if _kernels.backend() != "cuda":
        return None
    return _sm_count(getattr(mx.default_device(), "index", 0) or 0)


MMA_MAX_WAVES = 8  # waves of threadgroups the split count may take to even out the SMs' work


MMA_SPLIT_COST = 256  # a split's fixed cost (filling the copy ring, merging warps), in tokens


def mma_splits(
    tokens: int,
    rows: int,
    nwarps: int,
    sm_blocks: int = MMA_SM_BLOCKS,
    settings: KernelConfig | None = None,
) -> int:
    """Splits for the tensor-core kernel, at least :data:`MMA_MIN_SPAN` tokens each (no upper
    bound: its softmax is online).

    Where the device's SM count is known (:func:`sm_count`), the split count is sized to whole
    waves: ``rows x splits`` threadgroups run ``sm_blocks`` per SM at once (the register cap's
    occupancy), and a partly filled last wave costs nearly as much as a full one, so the count
    minimizes the busiest SM's work, ``waves x (tokens per split + MMA_SPLIT_COST)``, over
    split counts that fill 1 to :data:`MMA_MAX_WAVES` waves. ``KernelConfig.blocks`` (or an
    unknown SM count) asks for about that many threadgroups instead (default
    :data:`MMA_BLOCKS`). ``settings``: as :func:`sm_count`."""
    rows = max(1, rows)
    most = max(1, tokens // max(MMA_MIN_SPAN, 32 * nwarps))
    target = (settings or kernel_config()).blocks
    sms = sm_count(settings) if target is None else None
    if sms is None:
        s = min(max(1, math.ceil(int(target or MMA_BLOCKS) / rows)), most)
    else:
        slots = sms * (sm_blocks if sm_blocks > 0 else max(1, 8 // nwarps))
        counts = {most} | {min(most, w * slots // rows) for w in range(1, MMA_MAX_WAVES + 1)}

        def cost(c: int) -> tuple[int, int]:
            return math.ceil(rows * c / slots) * (math.ceil(tokens / c) + MMA_SPLIT_COST), c

        s = min((c for c in counts if c >= 1), key=cost, default=1)
    return math.ceil(tokens / math.ceil(tokens / s))


@dataclass(frozen=True)
class MmaLaunch:
    """How the tensor-core kernel is launched for one call (see :func:`mma_launch`)."""

    spec: KernelSpec
    template: list[tuple[str, int]]
    splits: int
    nwarps: int


def mma_launch(
    q_shape: tuple[int, int, int, int],
    query_dtype: mx.Dtype,
    keys: CodeRecord,
    values: CodeRecord,
    splits: int | None = None,
    scale: float | None = None,
    p_residual: bool | None = None,
    pipeline: bool | None = None,
    value_fold: bool | None = None,
    out_dtype: mx.Dtype | None = None,
    key_fold: bool | None = None,
    settings: KernelConfig | None = None,
) -> MmaLaunch | None:
    """The tensor-core kernel's launch for a ``(B, H, M, D)`` query over ``keys`` / ``values``
    from the settings (warps, steps of up to four tiles as two ring stages hold them, ring
    stages, register cap, splits; ``p_residual``, ``pipeline``, ``value_fold`` and
    ``key_fold`` default to theirs; ``out_dtype`` given: the kernel merges its splits into an
    output of that dtype), or None where no ring fits in shared memory. Everything but the
    split count is planned once per shape, codes and settings (the configuration record is
    part of the key: ``settings``, default the one in force)."""
    b, h, m, dim = q_shape
    t = keys.codes.shape[2]
    settings = settings or kernel_config()
    plan = mma_kernel_plan(
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
        settings,  # the settings in force (the plan reads them)
    )
    if plan is None:
        return None
    spec, tmpl, nwarps, sm_blocks = plan
    if splits is None:
        s = mma_splits(t, b * h, nwarps, sm_blocks, settings)
    else:
        s = max(1, min(int(splits), t))
        s = math.ceil(t / math.ceil(t / s))
    return MmaLaunch(spec, list(tmpl), s, nwarps)


@dataclass(frozen=True)
class MmaLayout:
    """Where the results of the tensor-core kernel merging its own splits (``FUSE`` 1) lie in
    its one float32 output (offsets and the total in float32 elements, every region whole 16
    bytes): the merged output (in its dtype, from offset 0), its (max, sum) and the
    threadgroup counts, then the partials. Without the merge the partials are the kernel's two
    outputs (:func:`velox_core.kernels.mma_support.mma_spec` with ``parts``)."""

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

    def merged(self, ws: mx.array) -> tuple[mx.array, mx.array, mx.array]:
        """``FUSE`` 1: the merged ``(o, m, l)`` as views of the MLX array ``ws`` (``o`` in
        the output dtype, ``m`` and ``l`` ``(B, H, M, 1)``)."""
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


def plan_mma(
    q_shape: tuple[int, int, int, int],
    q_dtype: mx.Dtype,
    keys: CodeRecord,
    values: CodeRecord,
    splits: int | None,
    scale: float | None,
    out_dtype: mx.Dtype | None = None,
    settings: KernelConfig | None = None,
):
    """The tensor-core kernel's launch for a fixed query shape, as ``run(q)``, or None where
    no ring fits. ``run`` returns the per-split partials and the query it took; with
    ``out_dtype`` the kernel merges its splits itself and ``run`` returns the merged
    ``(o, m, l)`` (``o`` normalized, in ``out_dtype``). ``settings``: as :func:`mma_launch`."""
    launch = mma_launch(
        q_shape,
        q_dtype,
        keys,
        values,
        splits,
        scale,
        out_dtype=out_dtype,
        settings=settings,
    )
    if launch is None:
        return None
    b, h, m, dim = q_shape
    s, nt = launch.splits, launch.nwarps * 32
    kc, ka, kb, kl = mma_inputs(keys)
    vc, va, vb, vl = mma_inputs(values)
    rest = [kc, ka, kb, vc, va, vb, kl, vl]
    kernel, tmpl = launch.spec.kernel(), launch.template
    # from the second launch on, the MLX kernel behind a CachedKernel (the variant is in the
    # disk cache then)
    plain = kernel.kernel if isinstance(kernel, CachedKernel) else kernel
    grid, tg = (s * nt, b * h, 1), (nt, 1, 1)
    if out_dtype is None:  # the partials as the kernel's two outputs (DECODE_MMA_PARTS)
        shapes = [(b, h, s, m, 2), (b, h, s, m, dim)]

        def run_parts(q):
            nonlocal kernel
            ml_part, o_part = kernel(
                inputs=[q, *rest],
                template=tmpl,
                grid=grid,
                threadgroup=tg,
                output_shapes=shapes,
                output_dtypes=[mx.float32, mx.float32],
            )
            kernel = plain
            return o_part, ml_part, q

        return run_parts
    lay = mma_layout(b, h, s, m, dim, out_dtype)
    size = [(lay.size,)]

    def run_fused(q):
        nonlocal kernel
        (ws,) = kernel(
            inputs=[q, *rest],
            template=tmpl,
            grid=grid,
            threadgroup=tg,
            output_shapes=size,
            output_dtypes=[mx.float32],
            init_value=0,
        )
        kernel = plain
        return lay.merged(ws)

    return run_fused


def mma_inputs(c: CodeRecord) -> tuple[mx.array, mx.array, mx.array, mx.array]:
    """One side's inputs of the tensor-core kernel (``kc, ka, kb`` or ``vc, va, vb``, then
    ``kl`` or ``vl``): codes, scales, zeros and levels. A codebook
    side has no zeros: its norms stand in for them (the kernel copies the plane but never
    reads it), and its levels are float32; an affine side's levels are a dummy."""
    if c.kind == CODEBOOK:
        lev = c.levels if c.levels.dtype == mx.float32 else c.levels.astype(mx.float32)
        return c.codes, c.a, c.a, lev
    return c.codes, c.a, c.b, unused_input(mx.float32)
