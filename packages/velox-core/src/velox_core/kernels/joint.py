"""One way from a coded segment to the decode kernels: its two kernel sides, planned here.

A codec reaches the fused decode kernels only through its kernel sides
(:meth:`velox_core.Codec.kernel_values`, :meth:`velox_core.Codec.kernel_keys`): each gives a
:class:`KernelSide` (the side's record of :mod:`velox_core.kernels.records`; for keys the
query the kernels score its codes with, for values the map from the codes' domain back to the
model's) or None. The functions here take sides, never a codec:

* :func:`plan_segment` plans :func:`velox_core.kernels.decode.plan_decode` once for a segment
  and a query shape and returns ``run(q, fp16)``: the normalized attention over the codes and
  up to two fp16 segments (a cache's sinks and window) in one softmax;
* :func:`segment_partial` is one segment's partial ``(o, m, l)`` for a log-sum-exp merge.

Which segments get here is decided in one place, the cache's
(:func:`velox_core.cache.attention.kernel_sides`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import mlx.core as mx

from . import decode as _kd  # plan_decode looked up per plan (tests spy on it)
from .records import CodeRecord

__all__ = ["JointQuery", "KernelSide", "plan_segment", "segment_partial"]

# run(q, fp16): q (B, H, M, D); fp16 up to two (keys, values) pairs (B, H, T_i, D); returns
# (B, H, M, D) in the plan's out_dtype, or None where the fp16 segments do not fit the merge
JointRun = Callable[[mx.array, list[tuple[mx.array, mx.array]]], mx.array | None]


@dataclass(frozen=True)
class KernelSide:
    """One side of a coded segment as the decode kernels take it.

    Attributes:
        record: the side's codes (:class:`~velox_core.kernels.records.CodeRecord`).
        query: keys only: the kernel's query from the model's grouped query (a rotation, a
            transform into the codes' domain), or None: the model's query as it is. The
            fp16 tokens a plan joins are then scored with the model's query.
        query_dtype: the dtype ``query`` returns (None: the dtype it is given); the plan is
            made for it first.
        query_input: keys only: the per-call query-side input the keys' layout takes (a
            sketched query, query tables) from the kernel's query, or None.
        values: keys only: the value side as these keys' kernel reads it where that is not
            the value codec's own (a kernel of the keys' layout that reads values its own
            way), or None.
        back: values only: float32 ``A`` with ``x = x_codes @ A`` (the map from the domain
            the values are coded in back to the model's), ``(D, D)`` or one per batch row and
            KV head ``(B, H, D, D)`` (the partial takes it; the joint merge maps back by one
            ``(D, D)`` matrix only and declines the other), or None: the model's domain.
    """

    record: CodeRecord
    query: Callable[[mx.array], mx.array] | None = None
    query_dtype: mx.Dtype | None = None
    query_input: Callable[[mx.array], mx.array] | None = None
    values: KernelSide | None = None
    back: mx.array | None = None


@dataclass(frozen=True)
class JointQuery:
    """The queries a joint plan takes and what it returns.

    Attributes:
        shape: ``(B, H, M, D)``, the grouped queries ``run`` is given.
        dtype: their dtype.
        fp16_tokens: the fp16 tokens ``run`` is given (0: none, which lets a kernel merge its
            own splits).
        out_dtype: the dtype of ``run``'s output.
        scale: the attention scale when the queries come unscaled; None: float32 queries with
            the scale applied.
    """

    shape: tuple[int, int, int, int]
    dtype: mx.Dtype
    fp16_tokens: int
    out_dtype: mx.Dtype
    scale: float | None = None


def _kernel_query(keys: KernelSide, q: mx.array) -> tuple[mx.array, mx.array | None]:
    """The kernel's query and its query-side input from the model's query ``q``."""
    kq = q if keys.query is None else keys.query(q)
    return kq, None if keys.query_input is None else keys.query_input(kq)


def plan_segment(query: JointQuery, keys: KernelSide, values: KernelSide) -> JointRun | None:
    """The decode kernel and the fp16 merge planned for ``query`` over one segment's sides:
    ``run(q, fp16)``, or None where no kernel takes the shape.

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
    }

    def plan(dtype: mx.Dtype):
        return _kd.plan_decode(query.shape, dtype, keys.record, values.record, **flags)

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
    out = _kd.decode_attention(kq, keys.record, values.record, q_sketch=qs)
    if out is None or values.back is None:
        return out
    o, m, l = out
    return o @ values.back, m, l
