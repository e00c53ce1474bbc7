"""The tensor-core decode kernel's settings and variants, planned once per shape.

The kernel's settings are fields of :class:`~velox_core.kernels.config.KernelConfig` (warps,
register cap, tiles per step, ring stages, the scale folds, ldmatrix); the ``mma_*`` functions
here are the rules that need more than a field; :func:`mma_kernel_plan` works out a variant
(template, warps, register cap) from them once per shape, codes and settings (a cache of its
own: a decode plan meets it again at every flush); :func:`run_subnormal_probe`
is the one-off probe of the device's fp16 subnormal MMA operands, which the folds rely on.
Which segments the kernel takes, its splits and its launch are :mod:`.mma`'s.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import mlx.core as mx

from .build import KernelSpec
from .config import KernelConfig, kernel_config
from .disk_cache import CachedKernel, at_once
from .layout import qmul_bits, unused_input
from .records import (
    AFFINE,
    AFFINE_CHANNEL,
    CODEBOOK,
    AffineCodes,
    ChannelAffineCodes,
    CodebookCodes,
    CodeRecord,
)

__all__ = ["mma_enabled"]

# one MMA on subnormal codes: whether the tensor cores take them exactly (the folds rely on it)
PROBE_SUBNORMAL = KernelSpec(
    name="velox_probe_subnormal_mma",
    source="probe_subnormal_mma.cu",
    inputs=("salt_in",),
    outputs=("out",),
    cuda_headers=("velox_mma.cuh",),
)


def mma_enabled() -> bool:
    """The tensor-core kernel is used on CUDA unless ``KernelConfig.mma`` 0."""
    return kernel_config().mma


# query dtypes that go into the score MMA as they are (QLO = 0), converted to fp16: exact for
# fp16, and for bfloat16 channels of magnitude 2^-17 to 65504 (8 significant bits within fp16's
# 11 and its subnormal spacing 2^-24; with the key fold's factor 2^-o, from 2^(o - 17)); smaller
# ones round to 2^-25 absolute (QLO = 1 would only add a second MMA of near-zero lo parts)
MMA_HALF_QUERY = (mx.float16, mx.bfloat16)


def codebook_mode(c: CodeRecord) -> int:
    """``KCB`` / ``VCB``: 0 affine, 1 codebook, 2 a codebook the caller vouches is symmetric
    (:attr:`CodebookCodes.symmetric`: 4 bits in half the table, 2 bits without permutes) while
    ``KernelConfig.symmetric`` allows it (0 looks every codebook up as general levels, for
    comparison)."""
    if c.kind != CODEBOOK:
        return 0
    return 2 if c.symmetric and kernel_config().symmetric else 1


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


# static shared memory of one threadgroup (the rest of 48 KiB: row stats and mbarriers)
MMA_SMEM = 48 * 1024 - 1024


MMA_SM_BLOCKS = 3  # threadgroups per SM the register cap aims for (KernelConfig.mma_sm_blocks)


def mma_sm_blocks(nwarps: int) -> int:
    """Threadgroups of ``nwarps`` warps per SM that the tensor-core kernel's register cap
    (``__launch_bounds__``) allows: ``KernelConfig.mma_sm_blocks``, else
    :data:`MMA_SM_BLOCKS` x 4 warps' worth of threadgroups (12 warps per SM, 168 registers,
    for steps of one or two tiles alike: with the scores transposed both fit); 0 leaves the
    registers to the compiler."""
    n = kernel_config().mma_sm_blocks
    return MMA_SM_BLOCKS * 4 // nwarps if n is None else n


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


def _probe_inputs(salt: int) -> list[mx.array]:
    return [mx.array([salt], dtype=mx.uint32)]


def run_subnormal_probe(salt: int = SUBNORMAL_SALT) -> float:
    """Run the probe on the default device (a CUDA GPU): its error (0.0: exact). Evaluated at
    once, so its compile is waited for wherever it runs (:func:`~.disk_cache.at_once`)."""
    with at_once():
        (out,) = PROBE_SUBNORMAL.kernel()(
            inputs=_probe_inputs(salt),
            grid=(32, 1, 1),
            threadgroup=(32, 1, 1),
            output_shapes=[(128,)],
            output_dtypes=[mx.float32],
        )
        return subnormal_probe_error(out, salt)


def subnormal_probe_ahead(salt: int = SUBNORMAL_SALT) -> None:
    """Start compiling the probe in the background (:meth:`~.disk_cache.CachedKernel.ahead`),
    where its compiled forms are kept on disk."""
    kernel = PROBE_SUBNORMAL.kernel()
    if isinstance(kernel, CachedKernel):
        kernel.ahead(_probe_inputs(salt), [mx.float32])


def mma_key_fold_ok(keys: CodeRecord, dim: int) -> bool:
    """Whether the key scales and zeros can be folded out of the score MMA (``KFOLD``): a
    group holds 4 whole code words (the four lanes of a k-step read adjacent words: 64
    channels or more at 2 bits, 32 at 4, 16 at 8) and a token has at most
    :data:`MMA_KEY_FOLD_GROUPS` groups (one accumulator chain each). Per-channel keys fold
    their scales into the query instead (``KCH``)."""
    if keys.kind == AFFINE_CHANNEL:
        return False
    return keys.group % (4 * (32 // keys.bits)) == 0 and dim // keys.group <= MMA_KEY_FOLD_GROUPS


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
    that side's fold and ``ldsm``, which :func:`mma_kernel_plan` checks). ``KCH``: per-channel
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


def _layout_record(
    kind: int, bits: int, group: int, dtype: mx.Dtype, symmetric: bool
) -> CodeRecord:
    """A record of one side's layout as :func:`mma_kernel_plan` is keyed by it (kind, width,
    group, the scales' or norms' dtype, symmetric levels): placeholder arrays, for the plan's
    helpers, which read only the layout."""
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
def mma_kernel_plan(
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
    """:func:`velox_core.kernels.mma.mma_launch`'s plan without the splits: (spec, template,
    warps, threadgroups per SM). ``exact``: whether the device takes subnormal MMA operands
    exactly (:func:`velox_core.kernels.mma.mma_subnormals_exact`; both folds need it).
    ``settings``: the configuration in force, whose fields the plan takes where the arguments
    are None (and which keys the cache: the helpers read the same record). Steps hold at most
    ``settings.subtiles`` tiles, halved until two ring stages fit (at four warps, 4 for 2-bit
    keys and values, 2 for 4-bit and mixed 2/4-bit codes, 1 for 8-bit ones)."""
    keys, values = _layout_record(*kside), _layout_record(*vside)
    nwarps = settings.mma_warps
    sub = settings.subtiles
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
        settings.p_residual if p_residual is None else p_residual,
        settings.pipeline if pipeline is None else pipeline,
        exact and (settings.value_fold if value_fold is None else value_fold),
        out_dtype,
        key_fold=exact and (settings.key_fold if key_fold is None else key_fold),
        ldsm=settings.ldsm,
    )
    tm = dict(tmpl)
    if (tm["KCB"] and not (tm["KFOLD"] and tm["LDSM"])) or (
        tm["VCB"] and not (tm["VFOLD"] and tm["LDSM"])
    ):
        return None  # codebook codes go in only through the folds' ldmatrix layouts
    return mma_spec(nwarps, sm_blocks, out_dtype is None), tuple(tmpl), nwarps, sm_blocks
