"""GPU decode attention over OSCAR's codes, through velox-core's affine decode kernel.

OSCAR's codes are ``velox_core.Uniform``'s per-token affine codes in a rotated basis, so the
decode kernels read them as they are (``velox_core.kernels.records.AffineCodes``); only the
bases differ from a plain ``Uniform`` cache:

* :func:`attend_partial`: the query is rotated once (``q R_K``, an MLX op), the kernel scores
  it against the key codes and mixes the value codes in one pass split along the context, and
  the ``(M, D)`` partial is rotated back once (``o R_V^T``); ``m`` and ``l`` need no rotation;
* :func:`joint_call` (planned once per segment and query shape): the same kernel on the
  rotated query, then velox-core's fused merge, which maps the splits' weighted sum back with
  ``R_V^T`` (a ``(D, D)`` float32 matrix) and joins the cache's fp16 sinks and window, scored
  with the unrotated query, in one softmax.

Values may also be a plain per-token ``Uniform`` (no rotation). Both functions return None
where no kernel applies (kernels off or the CPU, other value codecs, per-channel values,
a shape the plan declines): the cache then takes the reference path (``scores`` / ``mix``),
which reads the same codes through ``mx.quantized_matmul``.
"""

from __future__ import annotations

import weakref

import mlx.core as mx

from velox_core import Packed
from velox_core.kernels import use_kernels
from velox_core.kernels.decode import decode_attention
from velox_core.kernels.joint import JointQuery, JointRun, joint_glue, plan_joint

__all__ = ["attend_partial", "joint_call"]


def _sides(key_codec, dim: int, keys: Packed, value_codec, values: Packed):
    """``(key rotation, value rotation or None, key record, value record)``, or None where the
    kernels do not apply."""
    if not use_kernels() or getattr(key_codec, "name", None) != "oscar-key":
        return None
    kq = getattr(key_codec, "_q", None)
    if kq is None or key_codec.stored_rotation() is None:
        return None
    name = getattr(value_codec, "name", None)
    if name == "oscar-value" and getattr(value_codec, "_q", None) is not None:
        vq, vrot = value_codec._q, value_codec.stored_rotation()
    elif name == "uniform" and getattr(value_codec, "axis", None) == "token":
        vq, vrot = value_codec, None
    else:
        return None
    if key_codec._dim != dim or (vrot is not None and value_codec._dim != dim):
        return None
    return key_codec.stored_rotation(), vrot, kq.kernel_codes(keys), vq.kernel_codes(values)


def attend_partial(
    key_codec, q: mx.array, keys: Packed, value_codec, values: Packed
) -> tuple[mx.array, mx.array, mx.array] | None:
    """Partial ``(o, m, l)`` of one segment from the codes (GPU kernel), or None.

    Shapes:
        q ``(B, H, M, D)`` float32, scale applied; returns ``(B, H, M, D)``,
        ``(B, H, M, 1)``, ``(B, H, M, 1)`` float32.
    """
    sides = _sides(key_codec, q.shape[-1], keys, value_codec, values)
    if sides is None:
        return None
    krot, vrot, kc, vc = sides
    out = decode_attention(krot.forward(q), kc, vc)
    if out is None:
        return None
    o, m, l = out
    return (o if vrot is None else vrot.inverse(o)), m, l


_INVERSE: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _inverse_matrix(rot, dim: int) -> mx.array:
    """``A`` (float32 ``(D, D)``) with ``rot.inverse(o) == o @ A``, once per rotation."""
    a = _INVERSE.get(rot)
    if a is None:
        a = rot.inverse(mx.eye(dim, dtype=mx.float32)).astype(mx.float32)
        mx.eval(a)
        _INVERSE[rot] = a
    return a


def _plan_joint(
    key_codec, query: JointQuery, keys: Packed, value_codec, values: Packed
) -> JointRun | None:
    """Normalized attention over this segment's codes and up to two fp16 segments (a cache's
    sinks and window) in one softmax (GPU kernels), planned once for the segment and the query
    shape: ``run(q, fp16)``, or None where :func:`attend_partial` would decline.

    Shapes:
        q ``(B, H, M, D)``: float32 with the scale applied, or unscaled (any float dtype)
        with ``scale``; fp16 pairs ``(B, H, T_i, D)`` in the model's basis; ``run`` returns
        ``(B, H, M, D)`` in ``out_dtype``.
    """
    dim = query.shape[-1]
    sides = _sides(key_codec, dim, keys, value_codec, values)
    if sides is None:
        return None
    krot, vrot, kc, vc = sides

    def prepare(q):  # the rotated query for the kernel, q itself for the fp16 keys
        return krot.forward(q), q, None

    rot = None if vrot is None else _inverse_matrix(vrot, dim)
    return plan_joint(query, kc, vc, prepare, kernel_dtype=mx.float32, merge_q=True, rot=rot)


joint_call = joint_glue(_plan_joint)
