"""GPU kernel path of VecInfer: fused decode attention over the codeword indices.

velox-core's portable decode kernel (``metal/decode_attention.metal``) takes VecInfer's
records as *vector* codes (``velox_core.kernels.records.VQCodes``): a threadgroup copies its
(batch row, KV head)'s codebook (``2**index_bits x vector`` floats) to threadgroup memory,
reads each token's packed indices once, and dots the query with each index's codeword (keys)
or adds the softmax weight times it to its accumulators (values): no key or value is rebuilt
in memory.
This is the paper's fused dequantize-and-compute kernel, as one body for Metal and CUDA.

* The keys live in the smoothed, Hadamard-transformed domain: the host transforms the query
  once per call (``(q * lambda) H``, :meth:`velox_vecinfer.VecInfer.transform_query`), so
  ``q' . k'`` is the score; a cache's fp16 sinks and window are scored against the original
  query in the same softmax (the fused merge's ``merge_q``).
* Values coded by VecInfer without a transform (the cache's setting) mix straight into the
  output; per-token ``Uniform`` values are taken too (composed caches). Transformed values
  are undone on the partial (:func:`attend_partial`); the one-softmax path with fp16 segments
  declines them (the merge has no per-head map back).

Where the kernel does not apply (kernels off or the CPU, a codec not yet fitted, a layout the
kernel's plan declines: a codebook larger than ``VQ_MAX_TABLE`` floats, a lane's indices not
filling whole words) the functions return None and the caller takes the reference path.

Encoding (:func:`encode_codes`): the host transforms the new vectors (MLX ops: the smoothing
and the Hadamard transform), then one kernel finds each sub-vector's nearest codeword (exact
float32 squared distances over the head's codebook) and packs the indices.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import mlx.core as mx

from velox_core import Packed, Uniform
from velox_core.kernels import decode as _kd
from velox_core.kernels import use_kernels
from velox_core.kernels.encode import vq_encode
from velox_core.kernels.joint import JointQuery, JointRun, joint_glue, plan_joint
from velox_core.kernels.records import AffineCodes, VQCodes

if TYPE_CHECKING:
    from .codec import VecInfer

__all__ = ["attend_partial", "encode_codes", "joint_call", "kernel_side"]


def _is_vecinfer(codec) -> bool:
    """Whether ``codec`` is a VecInfer codec, by its registered name (this glue depends on the
    codec's public attributes, never imports it: the codec imports the glue)."""
    return getattr(codec, "name", None) == "vecinfer"


def encode_codes(codec: VecInfer, y: mx.array) -> mx.array | None:
    """The packed indices of the nearest codewords of transformed vectors ``y`` (one pass of
    the VQ encode kernel, ``metal/encode_vq.metal``), or None where kernels do not run.

    Shapes:
        y ``(B, H, T, D)`` (``codec.transform`` of the input); returns ``(B, H, T, W)`` uint32.
    """
    if not use_kernels() or not codec.fitted:
        return None
    return vq_encode(y, codec.codebook, codec.index_bits, codec.vector)


def kernel_side(codec, packed: Packed) -> VQCodes | AffineCodes | None:
    """The decode kernel's view of one side's record: ``velox_core.kernels.records.VQCodes``
    (the codeword indices and the codebooks) for a fitted :class:`VecInfer`, ``AffineCodes``
    for a per-token ``Uniform``; None for anything else."""
    if _is_vecinfer(codec):
        if not codec.fitted:
            return None
        return VQCodes(
            bits=codec.index_bits,
            group=codec.vector,
            codes=packed.data["codes"],
            codebooks=codec.codebook,
        )
    if isinstance(codec, Uniform) and codec.axis == "token":
        return codec.kernel_codes(packed)
    return None


def _sides(codec: VecInfer, keys: Packed, value_codec, values: Packed):
    if not use_kernels() or not codec.fitted:
        return None
    ks, vs = kernel_side(codec, keys), kernel_side(value_codec, values)
    return None if ks is None or vs is None else (ks, vs)


def _values_transformed(value_codec) -> bool:
    return _is_vecinfer(value_codec) and (value_codec.smooth or value_codec.hadamard)


def attend_partial(
    codec: VecInfer, q: mx.array, keys: Packed, value_codec, values: Packed
) -> tuple[mx.array, mx.array, mx.array] | None:
    """:meth:`velox_core.Codec.attend_partial` of VecInfer keys: this segment's partial
    ``(o, m, l)`` from its codeword indices through the decode kernel, the query transformed
    and transformed values undone on the partial (shapes as there: q float32 with the scale
    applied), or None where no kernel applies."""
    if q.shape[-1] != codec.dim:
        return None
    sides = _sides(codec, keys, value_codec, values)
    if sides is None:
        return None
    out = _kd.decode_attention(codec.transform_query(q), *sides)
    if out is None or not _values_transformed(value_codec):
        return out
    o, m, l = out
    return value_codec.untransform(o), m, l


def _plan_joint(
    codec: VecInfer, query: JointQuery, keys: Packed, value_codec, values: Packed
) -> JointRun | None:
    """:meth:`velox_core.Codec.joint_call` of VecInfer keys: attention over this segment's
    codes and up to two fp16 segments (a cache's sinks and window) in one softmax (the
    decode kernel and the fused merge), planned once for the query shape: ``run(q, fp16)``,
    or None where :func:`attend_partial` would decline or the values are coded in a
    transformed domain.

    Shapes:
        q ``(B, H, M, D)``: float32 with the scale applied, or unscaled (any float dtype)
        with ``scale``; fp16 pairs ``(B, H, T_i, D)``; ``run`` returns ``(B, H, M, D)`` in
        ``out_dtype``.
    """
    if query.shape[-1] != codec.dim or _values_transformed(value_codec):
        return None
    sides = _sides(codec, keys, value_codec, values)
    if sides is None:
        return None
    # the codes are scored against the transformed query (float32), the fp16 keys against q
    return plan_joint(
        query,
        *sides,
        lambda q: (codec.transform_query(q), q, None),
        kernel_dtype=mx.float32,
        merge_q=True,
    )


joint_call = joint_glue(_plan_joint)
