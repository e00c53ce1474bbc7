"""Fused decode attention over packed codes (flash-decoding), for the GPU kernels.

One pass over the codes of a segment computes, for a few grouped query rows, the partial
``(o, m, l)`` of :func:`velox_core.cache.attention.partial`: ``o = sum_t exp(s_t - m) v_t``,
``m`` the row max of the scores and ``l = sum_t exp(s_t - m)``, all float32, so that
:func:`velox_core.cache.attention.merge_partials` joins it with the other segments into one
softmax. The context is split into chunks so that one sequence fills the GPU: every
threadgroup handles one chunk (``metal/decode_attention.metal``) and a second small kernel
merges the chunks with the log-sum-exp rule (``metal/decode_merge.metal``).

Keys and values are each one record of :mod:`velox_core.kernels.records`, one class per code
layout: **affine** per-group codes (:class:`AffineCodes`, ``x = scale * code + zero``, one
scale and zero per ``group`` channels of a token: :class:`velox_core.Uniform` with
``axis="token"``), **codebook** codes (:class:`CodebookCodes`, ``x = norm * levels[code]``, one
norm per token, in a rotated domain) or a layout a method package registers
(:mod:`velox_core.kernels.layout`), such as **vector** codes (each sub-vector of ``group``
channels the index of a codeword, ``x = codebook[code]``, one codebook per batch row and KV
head). Keys may also be **per-channel affine** codes (:class:`ChannelAffineCodes`), or of a
layout with its own key pass. Codes are uint32 words in velox's packing layout
(:mod:`velox_core.ops.packing`), any width 1 to 8 where a lane's channels fill whole words.

The plan, one way down to the launches: :func:`plan_segment` (a segment's kernel sides) and
:func:`plan_decode` (its records) decide once which kernel runs them (a layout's own, the
tensor-core one on CUDA where it takes the layout, else the portable one) and plan the
merge; :func:`decode_attention` and :func:`segment_partial` plan and run once. None where no
kernel takes the shape, so callers fall back to the reference.

Shapes:
    q ``(B, H, M, D)`` float32 with the scale applied; codes ``(B, H, T, ceil(D*bits/32))``
    uint32; affine scale/zero ``(B, H, T, D/group)``; codebook norm ``(B, H, T)`` and levels
    ``(2**bits,)``. Returns ``o (B, H, M, D)``, ``m`` and ``l`` ``(B, H, M, 1)``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import mlx.core as mx

from .. import kernels as _kernels  # backend() looked up per call (tests report another)
from .config import KernelConfig, kernel_config
from .disk_cache import compiling_ahead
from .layout import FP16_MAX, Layout, check_codes, layout_of, pad_rows
from .merge import merge_splits, plan_merge_fp16
from .mma import mma_fuse_merge, mma_supported, plan_mma, probe_ahead
from .portable import plan_portable
from .records import CodeRecord

if TYPE_CHECKING:
    from .joint import JointQuery, KernelSide

__all__ = ["decode_attention", "plan_decode", "plan_segment", "segment_partial"]

# run(q, fp16): q (B, H, M, D); fp16 up to two (keys, values) pairs (B, H, T_i, D); returns
# (B, H, M, D) in the plan's out_dtype, or None where the fp16 segments do not fit the merge
JointRun = Callable[[mx.array, list[tuple[mx.array, mx.array]]], mx.array | None]


def _check_call(
    q_shape, keys: CodeRecord, values: CodeRecord, fp16_tokens, out_dtype, merge_q, rot, q_sketch
) -> None:
    """The argument checks of :func:`decode_attention` that do not depend on array values."""
    if (fp16_tokens is not None) != (out_dtype is not None):
        raise ValueError("decode_attention: fp16 segments and out_dtype go together")
    if (rot is not None and not merge_q) or (merge_q and fp16_tokens is None):
        raise ValueError("decode_attention: rot needs merge_q, and merge_q fp16 segments")
    klay, vlay = layout_of(keys), layout_of(values)
    takes = klay.query_shape(keys, *q_shape) is not None
    if q_sketch != takes:
        raise ValueError(
            f"decode_attention: q_sketch goes with keys that take a query-side input (a "
            f"sketched query, query tables); these {klay.name} keys take "
            + ("one" if takes else "none")
        )
    if vlay.keys_only:
        raise ValueError(f"decode_attention: {vlay.name} codes are for keys only")


def probe_ahead_for(q_shape, keys: KernelSide, values: KernelSide, settings: KernelConfig) -> None:
    """Start compiling the tensor-core kernel's subnormal probe, which its first plan runs
    (:func:`~.mma.probe_ahead`), where :func:`plan_decode` gives a segment of these sides to
    that kernel for queries of ``q_shape``: the keys' layout has no kernel of its own, and on
    CUDA with ``KernelConfig.mma`` on, :func:`~.mma.mma_supported`."""
    k, v = keys.record, (keys.values or values).record
    if (
        type(layout_of(k)).own_kernel is Layout.own_kernel
        and _kernels.backend() == "cuda"
        and settings.mma
        and mma_supported(q_shape[2], q_shape[3], k, v)
    ):
        probe_ahead()


def plan_decode(
    q_shape: tuple[int, int, int, int],
    q_dtype: mx.Dtype,
    keys: CodeRecord,
    values: CodeRecord,
    splits: int | None = None,
    fp16_tokens: int | None = None,
    out_dtype: mx.Dtype | None = None,
    scale: float | None = None,
    merge_q: bool = False,
    rot: mx.array | None = None,
    q_sketch: bool = False,
    out_only: bool = False,
    settings: KernelConfig | None = None,
):
    """:func:`decode_attention` planned once for one coded segment and one query shape.

    The checks, the kernel's layout, template, splits and grid (and the merge's) are worked
    out here; the returned ``run(q, fp16=None, merge_q=None, q_sketch=None)`` only launches
    the kernels, so a decode step reuses it while the segment is unchanged (a cache passes
    tokens to its codes ``flush`` at a time). ``run`` returns what :func:`decode_attention`
    returns, or None where the fp16 segments it is given exceed :data:`FP16_MAX` tokens.
    Returns None where no kernel takes the shape, or a side's layout is turned off
    (``KernelConfig.layouts_off``).

    Args:
        q_shape, q_dtype: the queries ``run`` takes (see :func:`decode_attention`).
        fp16_tokens: with ``out_dtype``: the fp16 tokens of the segments ``run`` will join
            (0 lets the tensor-core kernel merge its own splits where it can; ``run`` must
            then be given none).
        merge_q, q_sketch: whether ``run`` is given these queries.
        out_only: with ``out_dtype``: ``run`` returns only ``o``, the normalized output (what
            a joint plan returns: :func:`plan_segment`).
        settings: the kernel configuration the plan is made under (default: the one in
            force, :func:`velox_core.kernels.config.kernel_config`; a cache's plan passes the
            one its segment's sides were made under).
        Others: as :func:`decode_attention`.
    """
    b, h, m, dim = q_shape
    t = keys.codes.shape[2]
    if t < 1 or values.codes.shape[2] != t:
        return None
    _check_call(q_shape, keys, values, fp16_tokens, out_dtype, merge_q, rot, q_sketch)
    settings = settings or kernel_config()
    off = settings.layouts_off
    if off and (layout_of(keys).name in off or layout_of(values).name in off):
        return None
    if out_only and out_dtype is None:
        raise ValueError("decode_attention: out_only needs out_dtype (the normalized output)")
    if fp16_tokens is not None and fp16_tokens > FP16_MAX:
        return None
    parts = None  # parts(q[, q_sketch]) -> (o_part, ml_part, the query the kernel took)
    takes_qs = True
    own = layout_of(keys).own_kernel(q_shape, keys, values, splits, scale)
    if own is not None:  # a kernel of the keys' layout's own (a method package's)
        parts = own
    elif _kernels.backend() == "cuda" and settings.mma and mma_supported(m, dim, keys, values):
        check_codes("key", keys, b, h, t, dim)
        check_codes("value", values, b, h, t, dim)
        if fp16_tokens == 0 and rot is None and mma_fuse_merge(t, settings):
            # no fp16 tokens to join: the kernel merges its own splits (one launch)
            fused = plan_mma(q_shape, q_dtype, keys, values, splits, scale, out_dtype, settings)
            if fused is not None:

                def run_fused(q, fp16=None, merge_q=None, q_sketch=None):
                    if fp16 and any(k.shape[2] for k, _ in fp16):
                        raise ValueError("decode_attention: planned without fp16 tokens")
                    out = fused(q)
                    return out[0] if out_only else out

                return run_fused
        else:
            parts = plan_mma(q_shape, q_dtype, keys, values, splits, scale, None, settings)
            takes_qs = False  # the tensor-core kernel takes no query sketch: run(q)

    if parts is None:
        parts = plan_portable(q_shape, keys, values, splits, scale, settings)
        if parts is None:
            return None
        takes_qs = True
    want_qs = layout_of(keys).query_shape(keys, b, h, m, dim) or q_shape
    merges: dict[int, Any] = {}  # the merge, per query rows the decode kernel took

    def run(q, fp16=None, merge_q=None, q_sketch=None):
        if q_sketch is not None and tuple(q_sketch.shape) != tuple(want_qs):
            raise ValueError(
                f"decode_attention: q_sketch {tuple(q_sketch.shape)} must be {tuple(want_qs)}"
            )
        if fp16 and (
            len(fp16) > 2
            or fp16[0][0].shape[2] + (fp16[-1][0].shape[2] if len(fp16) > 1 else 0) > FP16_MAX
        ):
            return None
        o_part, ml_part, qk = parts(q, q_sketch) if takes_qs else parts(q)  # qk: rows padded
        rows = o_part.shape[3]
        if out_dtype is not None:
            merge = merges.get(rows)
            if merge is None:
                merge = merges[rows] = plan_merge_fp16(b, h, rows, dim, out_dtype, scale, rot)
            mq = qk if merge_q is None else pad_rows(merge_q, rows)
            o, mm, ll = merge(o_part, ml_part, mq, fp16 or [])
        else:
            o, mm, ll = merge_splits(o_part, ml_part)
        if out_only:
            return o[:, :, :m] if rows > m else o
        if rows > m:
            o, mm, ll = o[:, :, :m], mm[:, :, :m], ll[:, :, :m]
        return o, mm, ll

    return run


def decode_attention(
    q: mx.array,
    keys: CodeRecord,
    values: CodeRecord,
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
        keys, values: the segment's code records (:class:`CodeRecord`: one class per
            layout, see :mod:`velox_core.kernels.records`); same head dim as ``q``.
        splits: number of context chunks (default :func:`choose_splits`).
        fp16: with ``out_dtype``: up to two fp16 segments ``(keys, values)`` joined in the same
            softmax by the merge (:func:`plan_merge_fp16`); ``o`` is then the normalized
            attention over all of them, in ``out_dtype``.
        out_dtype: see ``fp16``.
        scale: the attention scale, when ``q`` comes without it.
        merge_q, rot: with ``fp16``, for codes in a rotated domain: ``q`` is the
            rotated query, ``merge_q`` the unrotated one (scored against the fp16 keys) and
            ``rot`` the ``(D, D)`` float32 map back (``o @ rot``, see
            :func:`plan_merge_fp16`). ``merge_q`` alone: keys coded in another domain than
            the fp16 keys, values in the same one (transformed keys).
        q_sketch: with keys that carry a residual sketch (``keys.signs``): the sketched query
            ``(B, H, M, D)`` (times the sketch's constant), scaled like ``q``; with keys of a
            layout that takes another query-side input (a sketched query, query tables): that
            input in the layout's :meth:`~velox_core.kernels.layout.Layout.query_shape`, from
            the same ``q`` as the kernel takes (scaled or not).

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


def _kernel_query(keys: KernelSide, q: mx.array) -> tuple[mx.array, mx.array | None]:
    """The kernel's query and its query-side input from the model's query ``q``."""
    kq = q if keys.query is None else keys.query(q)
    return kq, None if keys.query_input is None else keys.query_input(kq)


def plan_segment(
    query: JointQuery,
    keys: KernelSide,
    values: KernelSide,
    settings: KernelConfig | None = None,
) -> JointRun | None:
    """The decode kernel and the fp16 merge planned for ``query`` over one segment's sides
    (:class:`~velox_core.kernels.joint.KernelSide`): ``run(q, fp16)``, or None where no kernel
    takes the shape (``settings``: as :func:`plan_decode`).

    Shapes:
        q ``(B, H, M, D)``: float32 with the scale applied, or unscaled (any float dtype)
        with ``query.scale``; fp16 pairs ``(B, H, T_i, D)`` in the model's domain; ``run``
        returns ``(B, H, M, D)`` in ``query.out_dtype``.
    """
    values = keys.values or values
    if values.back is not None and values.back.ndim != 2:
        return None
    # the fp16 keys are scored with the model's query where the kernel's is another, and
    # the merge maps coded values back (``rot``) with the model's query beside them
    merge_q = keys.query is not None or values.back is not None
    flags = {
        "fp16_tokens": query.fp16_tokens,
        "out_dtype": query.out_dtype,
        "scale": query.scale,
        "merge_q": merge_q,
        "rot": values.back,
        "q_sketch": keys.query_input is not None,
        "out_only": True,
        "settings": settings,
    }

    def plan(dtype: mx.Dtype):
        return plan_decode(query.shape, dtype, keys.record, values.record, **flags)

    first = keys.query_dtype or query.dtype
    if not merge_q and keys.query_input is None and first == query.dtype:
        # the model's query is the kernel's: the decode plan's own run (returning the
        # normalized output) is the joint run, one Python frame fewer a step
        return plan(first)
    plans = {first: plan(first)}  # per dtype of the kernel's query
    if plans[first] is None:
        return None

    def run(q: mx.array, fp16: list[tuple[mx.array, mx.array]]) -> mx.array | None:
        kq, qs = _kernel_query(keys, q)
        if kq.dtype not in plans:
            plans[kq.dtype] = plan(kq.dtype)
        launch = plans[kq.dtype]
        return None if launch is None else launch(kq, fp16, q if merge_q else None, qs)

    return run


def plan_segment_ahead(
    query: JointQuery,
    keys: KernelSide,
    values: KernelSide,
    settings: KernelConfig,
    fp16: list[tuple[tuple[int, ...], tuple[int, ...]]],
    fp16_dtype: mx.Dtype,
) -> None:
    """The launches of :func:`plan_segment`'s ``run`` for ``query`` over a segment of these
    sides and fp16 segments of these (key shape, value shape) in ``fp16_dtype``, made only to
    start their kernels' compiles in the background (:func:`~.disk_cache.compiling_ahead`):
    nothing is evaluated and the plan is dropped."""
    segs = [(mx.zeros(ks, fp16_dtype), mx.zeros(vs, fp16_dtype)) for ks, vs in fp16]
    with compiling_ahead():
        run = plan_segment(query, keys, values, settings)
        if run is not None:
            run(mx.zeros(query.shape, query.dtype), segs)


def segment_partial(
    q: mx.array, keys: KernelSide, values: KernelSide
) -> tuple[mx.array, mx.array, mx.array] | None:
    """One segment's partial ``(o, m, l)`` from its codes (the decode kernel and the split
    merge), or None where no kernel takes the shape.

    Shapes:
        q ``(B, H, M, D)`` float32 with the scale applied; returns ``(B, H, M, D)``,
        ``(B, H, M, 1)``, ``(B, H, M, 1)`` float32 (``o`` in the model's domain).
    """
    values = keys.values or values
    kq, qs = _kernel_query(keys, q)
    out = decode_attention(kq, keys.record, values.record, q_sketch=qs)
    if out is None or values.back is None:
        return out
    o, m, l = out
    return o @ values.back, m, l
