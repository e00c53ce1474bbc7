"""GPU kernel path of VecInfer: fused decode attention over the codeword indices.

velox-core's portable decode kernel (``metal/decode_attention.metal``) takes VecInfer's
records as *vector* codes (:class:`velox_vecinfer.layout.VQCodes`): a threadgroup copies its
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
  are undone on the partial (their side's ``back``, one matrix per batch row and KV head);
  the one-softmax path with fp16 segments declines them (the merge has one map back).

The codec gives the kernels its sides (:func:`kernel_keys`, :func:`kernel_values`); where the
kernel does not apply (kernels off or the CPU, a codec not yet fitted, a layout the kernel's
plan declines: a codebook larger than ``VQ_MAX_TABLE`` floats, a lane's indices not filling
whole words) the caller takes the reference path.

Encoding (:func:`encode_codes`): the host transforms the new vectors (MLX ops: the smoothing
and the Hadamard transform), then one kernel finds each sub-vector's nearest codeword (exact
float32 squared distances over the head's codebook) and packs the indices.
"""

from __future__ import annotations

import mlx.core as mx

from velox_core import Codec, Packed
from velox_core.kernels import use_kernels
from velox_core.kernels.build import KernelSpec
from velox_core.kernels.encode import THREADS
from velox_core.kernels.joint import KernelSide
from velox_core.kernels.records import AffineCodes, CodeRecord

from .layout import VQCodes

__all__ = ["VQ_ENCODE", "encode_codes", "kernel_keys", "kernel_values", "vq_encode"]

VQ_ENCODE = KernelSpec(
    name="velox_encode_vq",
    source="encode_vq.metal",
    package="velox_vecinfer",
    inputs=("y", "book"),
    outputs=("codes",),
)


def vq_encode(y: mx.array, book: mx.array, bits: int, group: int) -> mx.array | None:
    """Packed indices of the nearest codewords of ``y``'s sub-vectors, or None if the kernel
    does not apply: the nearest codeword of every sub-vector (:func:`velox_core.ops.assign`)
    followed by :func:`velox_core.ops.pack` (``metal/encode_vq.metal``). The kernel ranks
    codewords by the exact float32 squared distance, where the reference ranks
    ``||c||^2 - 2 y.c`` from a matmul: the two agree except where two codewords are equally
    near within rounding.

    Shapes:
        y ``(B, H, T, D)`` (cast to float32), ``group`` dividing ``D``; book ``(B, H,
        2**bits, group)`` (one codebook per batch row and head); returns ``(B, H, T,
        ceil((D / group) * bits / 32))`` uint32.
    """
    if y.ndim != 4 or not 1 <= bits <= 8 or group < 1 or y.shape[-1] % group:
        return None
    b, h, t, dim = y.shape
    if tuple(book.shape) != (b, h, 1 << bits, group) or b * h * t == 0:
        return None
    words = -(-(dim // group) * bits // 32)
    (codes,) = VQ_ENCODE.kernel()(
        inputs=[
            y.astype(mx.float32).reshape(b * h, t, dim),
            book.astype(mx.float32).reshape(b * h, 1 << bits, group),
        ],
        template=[("BITS", bits), ("GROUP", group), ("HD", dim)],
        grid=(b * h * t * words, 1, 1),
        threadgroup=(THREADS, 1, 1),
        output_shapes=[(b, h, t, words)],
        output_dtypes=[mx.uint32],
    )
    return codes


def encode_codes(codec: Codec, y: mx.array) -> mx.array | None:
    """The packed indices of the nearest codewords of transformed vectors ``y`` (one pass of
    the VQ encode kernel, :func:`vq_encode`), or None where kernels do not run.

    Shapes:
        y ``(B, H, T, D)`` (``codec.transform`` of the input); returns ``(B, H, T, W)`` uint32.
    """
    if not use_kernels() or not codec.fitted:
        return None
    return vq_encode(y, codec.codebook, codec.index_bits, codec.vector)


def _record(codec: Codec, packed: Packed) -> VQCodes:
    """The decode kernel's view of a record: the codeword indices and the codebooks."""
    return VQCodes(
        bits=codec.index_bits,
        group=codec.vector,
        codes=packed.data["codes"],
        codebooks=codec.codebook,
    )


def kernel_values(codec: Codec, packed: Packed, dim: int) -> KernelSide | None:
    """:meth:`velox_core.Codec.kernel_values` of VecInfer: the record as vector codes, with
    the map back from the transformed domain per batch row and KV head where the values are
    transformed (the partial takes it, the one-softmax merge declines it); None before the
    codec is fitted or for another head dim."""
    if not codec.fitted or dim != codec.dim:
        return None
    back = None
    if codec.smooth or codec.hadamard:  # rows untransform(e_i): x = y @ back
        b, h = codec.codebook.shape[:2]
        back = codec.untransform(mx.broadcast_to(mx.eye(dim), (b, h, dim, dim)))
    return KernelSide(_record(codec, packed), back=back)


def kernel_keys(codec: Codec, packed: Packed, q_shape, values: CodeRecord) -> KernelSide | None:
    """:meth:`velox_core.Codec.kernel_keys` of VecInfer: the record as vector codes scored
    against the transformed query (float32), beside VecInfer's own or per-token affine
    values; None before the codec is fitted or for another head dim."""
    if (
        not codec.fitted
        or q_shape[-1] != codec.dim
        or not isinstance(values, (VQCodes, AffineCodes))
    ):
        return None
    return KernelSide(_record(codec, packed), query=codec.transform_query, query_dtype=mx.float32)
