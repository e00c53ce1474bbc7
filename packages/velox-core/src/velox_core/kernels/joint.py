"""A coded segment as the decode kernels take it: its two kernel sides.

A codec reaches the fused decode kernels only through its kernel sides
(:meth:`velox_core.Codec.kernel_values`, :meth:`velox_core.Codec.kernel_keys`): each gives a
:class:`KernelSide` (the side's record of :mod:`velox_core.kernels.records`; for keys the
query the kernels score its codes with, for values the map from the codes' domain back to the
model's) or None. Which segments get there is decided in one place, the cache's
(:func:`velox_core.cache.attention.kernel_sides`); the plan takes sides, never a codec
(:func:`velox_core.kernels.decode.plan_segment`: ``run(q, fp16)``, the normalized attention
over the codes and up to two fp16 segments, a cache's sinks and window, in one softmax, for
the queries of a :class:`JointQuery`; :func:`velox_core.kernels.decode.segment_partial`: one
segment's partial ``(o, m, l)`` for a log-sum-exp merge).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import mlx.core as mx

from .records import CodeRecord

__all__ = ["JointQuery", "KernelSide"]


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
