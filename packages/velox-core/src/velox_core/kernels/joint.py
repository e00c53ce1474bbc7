"""Joint decode calls: one coded segment and a cache's fp16 sinks and window in one softmax.

:meth:`velox_core.Codec.joint_call` asks a codec's kernels module for a plan made once per
segment and query shape: a callable ``run(q, fp16)`` that only launches the kernels. The
method packages' glue shares two pieces here:

* :func:`joint_glue` turns a planner that takes the query's description as one record
  (:class:`JointQuery`) into the module function ``joint_call`` that ``Codec.joint_call``
  calls (codec first, then its arguments in order);
* :func:`plan_joint` plans :func:`velox_core.kernels.decode.plan_decode` for the record and
  returns ``run``: each call prepares the kernel's query from the model's (a rotation, query
  tables), launches the decode kernel and the merge that joins the fp16 tokens, and returns
  the normalized output. Where the model's query goes to the kernel as it is (no ``prepare``:
  affine codes), ``run`` is the decode plan's own.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import mlx.core as mx

from . import decode as _kd  # plan_decode looked up per plan (tests spy on it)
from .records import CodeRecord

__all__ = ["JointQuery", "JointRun", "joint_glue", "plan_joint"]

# run(q, fp16): q (B, H, M, D); fp16 up to two (keys, values) pairs (B, H, T_i, D); returns
# (B, H, M, D) in the plan's out_dtype, or None where the fp16 segments do not fit the merge
JointRun = Callable[[mx.array, list[tuple[mx.array, mx.array]]], mx.array | None]


@dataclass(frozen=True)
class JointQuery:
    """The queries a joint plan takes and what it returns (``Codec.joint_call``'s arguments
    beside the segment).

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


def joint_glue(plan: Callable[[Any, JointQuery, Any, Any, Any], JointRun | None]):
    """A kernels module's ``joint_call`` from ``plan(codec, query, keys, value_codec, values)``
    (``keys`` and ``values`` the segment's ``Packed`` records): the function
    ``Codec.joint_call`` calls, with ``plan``'s docstring."""

    def joint_call(
        codec, q_shape, q_dtype, keys, value_codec, values, fp16_tokens, out_dtype, scale=None
    ) -> JointRun | None:
        query = JointQuery(tuple(q_shape), q_dtype, fp16_tokens, out_dtype, scale)
        return plan(codec, query, keys, value_codec, values)

    joint_call.__doc__, joint_call.__module__ = plan.__doc__, plan.__module__
    joint_call.__qualname__ = "joint_call"
    return joint_call


def plan_joint(
    query: JointQuery,
    keys: CodeRecord,
    values: CodeRecord,
    prepare: Callable[[mx.array], tuple[mx.array, mx.array | None, mx.array | None]] | None = None,
    *,
    kernel_dtype: mx.Dtype | None = None,
    merge_q: bool = False,
    rot: mx.array | None = None,
    q_sketch: bool = False,
) -> JointRun | None:
    """The decode kernel and the fp16 merge planned for ``query``: ``run(q, fp16)``, or None
    where no kernel takes the shape.

    Args:
        query: what ``run`` is given and returns.
        keys, values: the segment's codes as the decode kernel reads them.
        prepare: ``prepare(q) -> (kernel_q, merge_q, q_sketch)``, the decode kernel's query,
            the query the merge scores the fp16 keys with (None: the kernel's) and the query
            sketch or tables (None where the keys take none) from the model's query; None
            passes ``q`` as it comes.
        kernel_dtype: the dtype of ``kernel_q`` planned for now (default ``query.dtype``); a
            ``kernel_q`` of another dtype is planned for at its first call.
        merge_q, rot, q_sketch: as :func:`~velox_core.kernels.decode.plan_decode`.
    """

    merge = {"fp16_tokens": query.fp16_tokens, "out_dtype": query.out_dtype, "scale": query.scale}
    flags = {"merge_q": merge_q, "rot": rot, "q_sketch": q_sketch, "out_only": True}

    def plan(dtype: mx.Dtype):
        return _kd.plan_decode(query.shape, dtype, keys, values, **merge, **flags)

    if prepare is None and kernel_dtype in (None, query.dtype):
        # the model's query is the kernel's, of the planned dtype: the decode plan's own run
        # (returning the normalized output) is the joint run, one Python frame fewer a step
        return plan(query.dtype)
    first = query.dtype if kernel_dtype is None else kernel_dtype
    plans = {first: plan(first)}  # per dtype of the kernel's query
    if plans[first] is None:
        return None

    def run(q: mx.array, fp16: list[tuple[mx.array, mx.array]]) -> mx.array | None:
        kernel_q, mq, qs = (q, None, None) if prepare is None else prepare(q)
        if kernel_q.dtype not in plans:
            plans[kernel_q.dtype] = plan(kernel_q.dtype)
        launch = plans[kernel_q.dtype]
        return None if launch is None else launch(kernel_q, fp16, mq, qs)

    return run
