"""Merging a split decode's partials with the log-sum-exp rule (``metal/decode_merge.metal``).

:func:`merge_splits` joins the splits of one coded segment into ``(o, m, l)``;
:func:`plan_merge_fp16` also joins up to two fp16 segments (the sinks and the window) into the
same softmax and normalizes, in one launch.
"""

from __future__ import annotations

import mlx.core as mx

from .build import KernelSpec
from .disk_cache import CachedKernel
from .layout import FP16_MAX, qmul_bits, unused_input

__all__ = ["MERGE", "merge_launch", "merge_splits", "plan_merge_fp16"]

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

MERGE_THREADS = 256  # the merge body assumes 8 warps per threadgroup


def merge_launch(rows: int, dim: int) -> tuple[tuple[int, int, int], tuple[int, int, int]]:
    """Grid and threadgroup of the merge kernel: one threadgroup per (query row, 32 channels)."""
    return (rows * -(-dim // 32) * MERGE_THREADS, 1, 1), (MERGE_THREADS, 1, 1)


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


def plan_merge_fp16(b: int, h: int, rows: int, dim: int, out_dtype, scale, rot):
    """The normalized attention over a decode kernel's splits and up to two fp16 segments, in
    one launch (``metal/decode_merge_fp16.metal``), for fixed shapes, as
    ``run(o_part, ml_part, q, fp16)``: its template (per number of non-empty fp16 segments)
    and launch worked out once.

    Args:
        b, h, rows, dim: the shapes the decode kernel's partials have.
        out_dtype: dtype of the output.
        scale: the attention scale, when ``q`` comes without it.
        rot: ``(D, D)`` float32: the partials are in a rotated domain and ``o @ rot`` maps
            them back; ``q`` is then the unrotated query.

    ``run`` takes:
        o_part, ml_part: the decode kernel's per-split partials.
        q: the queries the decode kernel took, ``(B, H, R, D)``: float32 with the attention
            scale applied, or (with ``scale``) unscaled in any float dtype.
        fp16: up to two ``(keys, values)`` pairs ``(B, H, T_i, D)`` (any float dtype,
            ``sum T_i <= FP16_MAX``, which the caller checks), e.g. a cache's sinks and recent
            window.

    Shapes:
        ``run`` returns ``o (B, H, R, D)`` in ``out_dtype`` (softmax-weighted values), ``m``
        and ``l`` ``(B, H, R, 1)`` float32.
    """
    if rot is not None and (rot.shape != (dim, dim) or rot.dtype != mx.float32):
        raise ValueError(
            f"plan_merge_fp16: rot must be float32 ({dim}, {dim}), got {rot.dtype} "
            f"{tuple(rot.shape)}"
        )
    kernel = MERGE_FP16.kernel()
    grid, tg = merge_launch(b * h * rows, dim)
    common = [("FMAX", FP16_MAX), ("QMUL", qmul_bits(scale)), ("RD", 1 if rot is None else dim)]
    templates = [[("HAS_A", int(n > 0)), ("HAS_B", int(n > 1)), *common] for n in range(3)]
    dummy = unused_input(mx.float16)
    last = unused_input(mx.float32) if rot is None else rot
    shapes = [(b, h, rows, dim), (b, h, rows, 1), (b, h, rows, 1)]
    dtypes = [out_dtype, mx.float32, mx.float32]

    # per template: the kernel until its variant has been launched once (compiled into the
    # disk cache by a CachedKernel), then the MLX kernel behind it
    calls = [kernel] * len(templates)
    plain = kernel.kernel if isinstance(kernel, CachedKernel) else kernel

    def run(o_part, ml_part, q, fp16):
        segs = [(k, v) for k, v in fp16 if k.shape[2] > 0]
        n = len(segs)
        ak, av = segs[0] if segs else (dummy, dummy)
        bk, bv = segs[1] if n > 1 else (dummy, dummy)
        out = calls[n](
            inputs=[o_part, ml_part, q, ak, av, bk, bv, last],
            template=templates[n],
            grid=grid,
            threadgroup=tg,
            output_shapes=shapes,
            output_dtypes=dtypes,
        )
        calls[n] = plain
        return out

    return run
