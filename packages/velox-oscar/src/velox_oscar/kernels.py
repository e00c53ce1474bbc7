"""GPU decode attention over OSCAR's codes, through velox-core's affine decode kernel.

OSCAR's codes are ``velox_core.Uniform``'s per-token affine codes in a rotated basis, so the
decode kernels read them as they are (``velox_core.kernels.records.AffineCodes``); only the
bases differ from a plain ``Uniform`` cache. The codecs give the kernels their sides
(:func:`kernel_keys`, :func:`kernel_values`, velox-core's ``KernelSide``):

* keys: the codes scored against the rotated query (``q R_K``, an MLX op once per call);
* values: the codes mixed in their rotated basis, mapped back by ``R_V^T`` (a ``(D, D)``
  float32 matrix, made once per rotation): on the partial, or by velox-core's fused merge,
  which joins the cache's fp16 sinks and window, scored with the unrotated query, in one
  softmax.

Values may also be a plain per-token ``Uniform`` (no rotation). Where no side is given
(another head dim, a codec not set up yet, keys beside values of another layout) the cache
takes the reference path (``scores`` / ``mix``), which reads the same codes through
``mx.quantized_matmul``.
"""

from __future__ import annotations

import weakref

import mlx.core as mx

from velox_core import Codec, Packed
from velox_core.kernels.joint import KernelSide
from velox_core.kernels.records import AffineCodes, CodeRecord

__all__ = ["kernel_keys", "kernel_values"]

_INVERSE: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _inverse_matrix(rot, dim: int) -> mx.array:
    """``A`` (float32 ``(D, D)``) with ``rot.inverse(o) == o @ A``, once per rotation."""
    a = _INVERSE.get(rot)
    if a is None:
        a = rot.inverse(mx.eye(dim, dtype=mx.float32)).astype(mx.float32)
        mx.eval(a)
        _INVERSE[rot] = a
    return a


def kernel_values(codec: Codec, packed: Packed, dim: int) -> KernelSide | None:
    """:meth:`velox_core.Codec.kernel_values` of OSCAR's values: the codes as per-token affine
    values, mapped back by the inverse of the value rotation; None before the codec is set
    up for head dim ``dim``."""
    q = getattr(codec, "_q", None)
    if getattr(codec, "name", None) != "oscar-value" or q is None or codec._dim != dim:
        return None
    rot = codec.stored_rotation()
    back = None if rot is None else _inverse_matrix(rot, dim)
    return KernelSide(q.kernel_codes(packed), back=back)


def kernel_keys(codec: Codec, packed: Packed, q_shape, values: CodeRecord) -> KernelSide | None:
    """:meth:`velox_core.Codec.kernel_keys` of OSCAR's keys: the codes as per-token affine keys
    scored against the rotated query (float32), beside per-token affine values (OSCAR's or a
    plain ``Uniform``'s); None before the codec is set up for this head dim, and for centred
    keys (``centre=True``: the fp16 sinks and window the kernels join are scored with the
    model's query against the keys themselves, and the kernels have no per-query term for the
    codes' ``q . mu``)."""
    q, rot = getattr(codec, "_q", None), codec.stored_rotation()
    if getattr(codec, "name", None) != "oscar-key" or q is None or rot is None:
        return None
    if getattr(codec, "centre", False):  # the kernels would leave out each query's q . mu
        return None
    if codec._dim != q_shape[-1] or type(values) is not AffineCodes:
        return None
    return KernelSide(q.kernel_codes(packed), query=rot.forward, query_dtype=mx.float32)
