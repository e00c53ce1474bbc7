"""The tensor-core decode kernel (CUDA, ``metal/decode_attention_mma.cu`` bodies): template,
launch plan, input layout and launch.

:func:`mma_launch` plans a call (kernel variant, template, splits, warps) once per shape,
codes and settings; :func:`plan_mma` returns the launch that :mod:`.decode` runs.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass
from typing import Any

import mlx.core as mx

from .build import KernelSpec
from .codes import qmul_bits
from .config import KernelConfig, kernel_config
from .disk_cache import direct
from .layout import unused_input
from .mma_support import (
    MMA_HALF_QUERY,
    codebook_mode,
    mma_fold_ok,
    mma_key_fold,
    mma_key_fold_ok,
    mma_ldsm,
    mma_p_residual,
    mma_pipeline,
    mma_sm_blocks,
    mma_splits,
    mma_stages,
    mma_subnormals_exact,
    mma_subtiles,
    mma_value_fold,
    mma_warps,
)
from .records import (
    AFFINE,
    AFFINE_CHANNEL,
    CODEBOOK,
    AffineCodes,
    ChannelAffineCodes,
    CodebookCodes,
    CodeRecord,
)

__all__ = ["mma_launch", "plan_mma"]

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


def mma_template(
    dim: int,
    keys: CodeRecord,
    values: CodeRecord,
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
    that side's fold and ``ldsm``, which :func:`mma_launch` checks). ``KCH``: per-channel
    affine keys (``kind`` :data:`AFFINE_CHANNEL`, KIVI's: ``keys.group`` tokens a scale row,
    a multiple of 16): their scales are folded into the query per group of tokens and their
    zeros' term added to the scores (no ``KFOLD``)."""
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
        ("KCB", codebook_mode(keys)),
        ("VCB", codebook_mode(values)),
        ("KCH", int(keys.kind == AFFINE_CHANNEL)),
    ]


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
) -> MmaLaunch | None:
    """The tensor-core kernel's launch for a ``(B, H, M, D)`` query over ``keys`` / ``values``
    from the settings (warps, steps of up to four tiles as two ring stages hold them, ring
    stages, register cap, splits; ``p_residual``, ``pipeline``, ``value_fold`` and
    ``key_fold`` default to theirs; ``out_dtype`` given: the kernel merges its splits into an
    output of that dtype), or None where no ring fits in shared memory. Everything but the
    split count is planned once per shape, codes and settings (the configuration record is
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
        kernel_config(),  # the settings in force (the plan reads them)
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


def _layout_record(
    kind: int, bits: int, group: int, dtype: mx.Dtype, symmetric: bool
) -> CodeRecord:
    """A record of one side's layout as :func:`_mma_plan` is keyed by it (kind, width, group,
    the scales' or norms' dtype, symmetric levels): placeholder arrays, for the plan's helpers,
    which read only the layout."""
    u32, s, f32 = unused_input(mx.uint32), unused_input(dtype), unused_input(mx.float32)
    if kind == CODEBOOK:
        return CodebookCodes(
            bits=bits, dim=group, codes=u32, norm=s, levels=f32, symmetric=symmetric
        )
    if kind == AFFINE_CHANNEL:
        return ChannelAffineCodes(bits=bits, group=group, codes=u32, scale=s, zero=s)
    if kind == AFFINE:
        return AffineCodes(bits=bits, group=group, codes=u32, scale=s, zero=s)
    raise ValueError(f"mma_launch: the tensor-core kernel takes no codes of kind {kind}")


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
    settings: KernelConfig,
) -> tuple[KernelSpec, tuple[tuple[str, int | mx.Dtype], ...], int, int] | None:
    """:func:`mma_launch`'s plan without the splits: (spec, template, warps, threadgroups
    per SM). ``exact``: whether the device takes subnormal MMA operands exactly
    (:func:`mma_subnormals_exact`; both folds need it). ``settings`` (the configuration in
    force) only keys the cache: the helpers read the same record."""
    keys, values = _layout_record(*kside), _layout_record(*vside)
    nwarps = mma_warps()
    sub = mma_subtiles()
    qlo = query_dtype not in MMA_HALF_QUERY
    stages = mma_stages(dim, keys, values, nwarps, sub, qlo)
    while stages == 0 and sub > 1:  # fewer tiles a step where two stages do not fit
        sub //= 2
        stages = mma_stages(dim, keys, values, nwarps, sub, qlo)
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


def plan_mma(
    q_shape: tuple[int, int, int, int],
    q_dtype: mx.Dtype,
    keys: CodeRecord,
    values: CodeRecord,
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
    plain = direct(kernel)  # called from the second launch on (the variant is compiled then)
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
