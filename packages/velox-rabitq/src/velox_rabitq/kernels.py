"""GPU kernel path of RaBitQ keys: fused decode attention over the packed codes.

A RaBitQ score is ``<q, c> + Delta / <o_bar, o> * <P^-1 q, y>`` with ``y = u - (2^B - 1)/2``
the centred grid point of the stored codes ``u`` (:mod:`velox_rabitq.codec`). With the query
rotated once per call (``q' = P^-1 q``, MLX ops) the residual term is an affine code over
the whole head, one group of ``D`` channels a token:

    Delta / <o_bar, o> * <q', u - (2^B - 1)/2> = <q', scale * u + zero>,
    scale = Delta / <o_bar, o>,  zero = -scale * (2^B - 1)/2,

and ``u`` is packed by velox-core's packing (:func:`velox_core.ops.pack`), the layout of
``velox_core.Uniform``'s codes. So velox-core's decode kernels read RaBitQ records as
:class:`~velox_core.kernels.records.AffineCodes` keys of ``B`` bits (1 to 8) and group ``D``,
with the per-token ``scale`` and ``zero`` computed from the record's ``delta`` and ``ip`` in fp16
(also for a bf16 model's records: in bf16 the zero's rounding cancels more of each score):
the portable kernel
(``metal/decode_attention.metal``) on Metal and for 1, 3, 5, 6, 7 bits on CUDA, the
tensor-core kernel (``metal/decode_attention_mma.cu``) for 2, 4 and 8 bits on CUDA. Values are
mixed from their per-token ``Uniform`` codes in the same pass.

The centroid term ``<q, c>`` depends on the query, so no per-token zero absorbs it. It is
constant over each block of ``centroid`` tokens, so the kernel is launched with **one split
per centroid block** (a split's partial ``(o, m, l)`` over its tokens, ``m`` its max score),
and the block's ``<q, c>`` is added to that split's max before the splits are merged (the
layout of :mod:`velox_rabitq.layout`, its own kernel). ``<q, c>`` for every block is one small
MLX matmul per call (``(M, D) x (D, T / centroid)``, split into bfloat16 parts so that a GPU's
TF32 products keep float32 precision); then velox-core's merge kernels join the splits (and a
cache's fp16 sinks and window, scored against the unrotated query, in one softmax).
``centroid=0`` needs none of this: the kernel's own split choice and merge
(:func:`velox_core.kernels.decode.plan_decode`).

The codec gives the kernels its key side (:func:`kernel_keys`); where the kernel does not
apply the caller takes the reference path (:meth:`velox_rabitq.RaBitQ.scores` and the value
codec's ``mix``): kernels off or the CPU, a codec not yet bound to a head dim, values that
are not a per-token ``Uniform``, a layout the kernels' plans decline, or centroid blocks
longer than a split of the portable kernel (``4096 / rows`` tokens for its query rows a
pass) where the tensor-core kernel does not take them (it needs blocks of whole tiles of
``16 x NSUB`` tokens).
"""

from __future__ import annotations

import mlx.core as mx

from velox_core import Codec, Packed
from velox_core.kernels.joint import KernelSide
from velox_core.kernels.records import AffineCodes, CodeRecord

from .layout import BlockCodes, block_parts

__all__ = ["affine_codes", "kernel_keys"]


def affine_codes(codec: Codec, keys: Packed) -> AffineCodes:
    """The decode kernels' view of a RaBitQ key record: ``velox_core.kernels.records.AffineCodes``
    of ``codec.bits`` bits in one group of ``D`` channels, ``scale = Delta / <o_bar, o>``
    and ``zero = -scale (2^B - 1)/2`` per token, in fp16 for fp16 and bf16 records (the zero
    from the rounded scale, so that ``scale * u + zero`` is the scaled grid point up to the
    zero's own rounding). The centroid is not part of it (see the module).

    Shapes:
        codes ``(B, H, T, ceil(D bits / 32))`` uint32 (the record's); scale and zero
        ``(B, H, T, 1)``.
    """
    p = keys.data
    dt = p["delta"].dtype
    # a bf16 record's scale and zero go to the kernel as fp16 (3 more mantissa bits, so the
    # zero's rounding cancels less of each score); fp16 holds them up to residual norms ~4e5
    dt = mx.float16 if dt == mx.bfloat16 else dt
    scale = (p["delta"].astype(mx.float32) / p["ip"].astype(mx.float32)).astype(dt)
    zero = (scale.astype(mx.float32) * -(((1 << codec.bits) - 1) / 2)).astype(dt)
    return AffineCodes(
        bits=codec.bits,
        group=codec.dim,
        codes=p["codes"],
        scale=scale[..., None],
        zero=zero[..., None],
    )


def kernel_keys(codec: Codec, packed: Packed, q_shape, values: CodeRecord) -> KernelSide | None:
    """:meth:`velox_core.Codec.kernel_keys` of RaBitQ: the codes as affine keys
    (:func:`affine_codes`) scored against the rotated query (float32), beside per-token
    affine values; with centroids, in their blocks (:class:`velox_rabitq.layout.BlockCodes`,
    each block's centroid rotated as the query is). None where no kernel applies: a codec
    not yet bound to this head dim, values of another layout, or centroid blocks no kernel
    takes (:func:`velox_rabitq.layout.block_parts`)."""
    if codec.dim is None or q_shape[-1] != codec.dim or type(values) is not AffineCodes:
        return None
    rec = affine_codes(codec, packed)
    if codec.centroid:
        if block_parts(tuple(q_shape), rec, values, codec.centroid) is None:
            return None
        c = codec.rotation.forward(packed.data["centroid"].astype(mx.float32))
        rec = BlockCodes(affine=rec, centroids=mx.swapaxes(c, -1, -2), block=codec.centroid)
    return KernelSide(rec, query=codec.rotation.forward, query_dtype=mx.float32)
