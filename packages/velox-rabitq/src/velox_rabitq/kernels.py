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
and the block's ``<q, c>`` is added to that split's max before the splits are merged: with
``s_t + b`` for every token of a split, ``exp(s_t + b - (m + b)) = exp(s_t - m)``, so ``o``
and ``l`` stand and ``m + b`` is the split's max, exactly. ``<q, c>`` for every block is one
small MLX matmul per call (``(M, D) x (D, T / centroid)``, split into bfloat16 parts so that a
GPU's TF32 products keep float32 precision); then velox-core's merge kernels join the splits
(and a cache's fp16 sinks and window, scored against the unrotated query, in one softmax).
``centroid=0`` needs none of this: the kernel's own split choice and merge
(:func:`velox_core.kernels.decode.plan_decode`).

Where the kernel does not apply the functions return None and the caller takes the
reference path (:meth:`velox_rabitq.RaBitQ.scores` and the value codec's ``mix``): kernels
off or the CPU, a codec not yet bound to a head dim, values that are not a per-token
``Uniform``, a layout the kernels' plans decline, or centroid blocks longer than a split of
the portable kernel (``4096 / rows`` tokens for its query rows a pass) where the tensor-core
kernel does not take them (it needs blocks of whole tiles of ``16 x NSUB`` tokens).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import mlx.core as mx

from velox_core import Packed, Uniform
from velox_core import kernels as _vk  # backend() looked up per call (tests report another)
from velox_core.kernels import decode as _kd
from velox_core.kernels import use_kernels
from velox_core.kernels.codes import FP16_MAX, LOG2E, check_codes
from velox_core.kernels.joint import JointQuery, JointRun, joint_glue, plan_joint
from velox_core.kernels.layout import pad_rows
from velox_core.kernels.merge import merge_splits, plan_merge_fp16
from velox_core.kernels.mma import mma_launch, plan_mma
from velox_core.kernels.mma_support import mma_enabled, mma_supported
from velox_core.kernels.portable import fit_splits, plan_for, plan_portable
from velox_core.kernels.records import AffineCodes

if TYPE_CHECKING:
    from .codec import RaBitQ

__all__ = ["attend_partial", "joint_call", "kernel_keys", "kernel_sides"]


def kernel_keys(codec: RaBitQ, keys: Packed) -> AffineCodes:
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


def kernel_sides(
    codec: RaBitQ, keys: Packed, value_codec, values: Packed
) -> tuple[AffineCodes, AffineCodes] | None:
    """Both records as the decode kernels read them, or None where no kernel applies: kernels
    off or the CPU, a codec not yet bound to a head dim, values not a per-token ``Uniform``.
    (A record holds whole centroid blocks: ``Packed`` checks it.)"""
    if not use_kernels() or codec.dim is None:
        return None
    if not isinstance(value_codec, Uniform) or value_codec.axis != "token":
        return None
    return kernel_keys(codec, keys), value_codec.kernel_codes(values)


def _tensor_core_blocks(q_shape, q_dtype, keys: AffineCodes, values, block, scale):
    """The tensor-core kernel's per-split launch with one split per centroid block, as
    ``run(q) -> (o_part, ml_part, q)``, or None where it does not take the shape or its tiles
    (``16 x NSUB`` tokens, a split's span rounded up to them) do not divide the block."""
    b, h, m, dim = q_shape
    if not (_vk.backend() == "cuda" and mma_enabled()):
        return None
    if not mma_supported(m, dim, keys, values):
        return None
    t = keys.codes.shape[2]
    nblk = t // block
    launch = mma_launch(q_shape, q_dtype, keys, values, nblk, scale)
    if launch is None or launch.splits != nblk or block % (16 * dict(launch.template)["NSUB"]):
        return None
    check_codes("key", keys, b, h, t, dim)
    check_codes("value", values, b, h, t, dim)
    return plan_mma(q_shape, q_dtype, keys, values, nblk, scale)


def _portable_blocks(q_shape, keys: AffineCodes, values, block, scale):
    """The portable kernel's launch with one split per centroid block, as
    ``run(q) -> (o_part, ml_part, q padded)``, or None where it has no layout for the shape
    or a block exceeds a split's ``max_span`` tokens."""
    _, _, m, dim = q_shape
    p = plan_for(m, dim, keys, values)
    if p is None or block > p.max_span:
        return None
    t = keys.codes.shape[2]
    nblk = t // block
    if fit_splits(t, nblk, p) != nblk:  # (each split is then exactly one block)
        return None
    return plan_portable(q_shape, keys, values, nblk, scale)


def _centroid_bias(q: mx.array, ct: mx.array, factor: float) -> mx.array:
    """``factor <q, c>`` for every query row and centroid block, float32, as the kernels' max
    scores take it (log2 units). A GPU runs float32 matmuls in TF32 (10-bit mantissas) unless
    ``MLX_ENABLE_TF32=0``; the centroids are fp16 / bf16 values, exact in TF32, so only the
    query is split into its bfloat16 part and the rest: ``q_hi C + q_lo C`` is the float32
    product to about ``2^-19`` of ``q``.

    Shapes:
        q ``(B, H, R, D)``; ct ``(B, H, D, T / centroid)`` float32; returns
        ``(B, H, T / centroid, R, 1)``, the layout of a split's max in ``ml_part``.
    """
    qf = q.astype(mx.float32)
    hi = qf.astype(mx.bfloat16).astype(mx.float32)
    qc = (hi @ ct + (qf - hi) @ ct) * factor  # (B, H, R, S)
    return mx.swapaxes(qc, 2, 3)[..., None]


class _Blocks:
    """The decode kernel over one RaBitQ segment with a centroid, planned once for a query
    shape: one split per centroid block, each split's max raised by the block's ``<q, c>``,
    then the splits merged (with up to two fp16 segments: :func:`joint_call`)."""

    def __init__(self, codec, q_shape, keys, values, centroids, scale, out_dtype=None):
        self.codec = codec
        self.scale = scale
        self.factor = LOG2E * (1.0 if scale is None else float(scale))
        # (B, H, D, T / centroid) float32, once per plan (the bias matmul's right side)
        self.ct = mx.swapaxes(centroids.astype(mx.float32), -1, -2)
        block = codec.centroid
        rotated = mx.float32  # the rotated query's dtype (Rotation.forward)
        self.parts = _tensor_core_blocks(q_shape, rotated, keys, values, block, scale)
        if self.parts is None:
            self.parts = _portable_blocks(q_shape, keys, values, block, scale)
        self.out_dtype = out_dtype
        self.merges: dict[int, Callable] = {}
        self.m = q_shape[2]

    def ready(self) -> bool:
        return self.parts is not None

    def __call__(self, q: mx.array, fp16=None):
        """Shapes: q ``(B, H, M, D)`` (scaled float32, or unscaled with the plan's scale);
        returns ``(o, m, l)`` as :func:`velox_core.kernels.decode.decode_attention`."""
        o_part, ml_part, _ = self.parts(self.codec.rotation.forward(q))
        rows = o_part.shape[3]  # the query rows the kernel took (padded to its row blocks)
        qp = pad_rows(q, rows)  # padded rows are zeros: their bias is 0
        bias = _centroid_bias(qp, self.ct, self.factor)
        ml_part = ml_part + mx.pad(bias, [(0, 0)] * 4 + [(0, 1)])
        if self.out_dtype is None:
            o, mm, ll = merge_splits(o_part, ml_part)
        else:
            merge = self.merges.get(rows)
            if merge is None:
                b, h, _, dim = q.shape
                merge = plan_merge_fp16(b, h, rows, dim, self.out_dtype, self.scale, None)
                self.merges[rows] = merge
            o, mm, ll = merge(o_part, ml_part, qp, fp16 or [])
        if rows > self.m:
            o, mm, ll = o[:, :, : self.m], mm[:, :, : self.m], ll[:, :, : self.m]
        return o, mm, ll


def attend_partial(
    codec: RaBitQ, q: mx.array, keys: Packed, value_codec, values: Packed
) -> tuple[mx.array, mx.array, mx.array] | None:
    """:meth:`velox_core.Codec.attend_partial` of RaBitQ keys: this segment's partial
    ``(o, m, l)`` from its codes through the decode kernels (q float32, scale applied), or
    None where they do not apply."""
    if q.shape[-1] != codec.dim:
        return None
    sides = kernel_sides(codec, keys, value_codec, values)
    if sides is None:
        return None
    if not codec.centroid:
        return _kd.decode_attention(codec.rotation.forward(q), *sides)
    run = _Blocks(codec, tuple(q.shape), *sides, keys.data["centroid"], None)
    return run(q) if run.ready() else None


def _plan_joint(
    codec: RaBitQ, query: JointQuery, keys: Packed, value_codec, values: Packed
) -> JointRun | None:
    """:meth:`velox_core.Codec.joint_call` of RaBitQ keys: this segment's codes and up to two
    fp16 segments (a cache's sinks and window, scored against the unrotated query) in one
    softmax, planned once for the segment and the query shape, or None where
    :func:`attend_partial` would decline."""
    if query.shape[-1] != codec.dim or query.fp16_tokens > FP16_MAX:
        return None
    sides = kernel_sides(codec, keys, value_codec, values)
    if sides is None:
        return None
    if codec.centroid:
        centroids, out_dtype = keys.data["centroid"], query.out_dtype
        blocks = _Blocks(codec, query.shape, *sides, centroids, query.scale, out_dtype=out_dtype)
        if not blocks.ready():
            return None

        def run_blocks(q, fp16):
            if len(fp16) > 2 or sum(k.shape[2] for k, _ in fp16) > FP16_MAX:
                return None
            return blocks(q, fp16)[0]

        return run_blocks
    # the codes are scored against the rotated query (float32), the fp16 keys against q
    return plan_joint(
        query,
        *sides,
        lambda q: (codec.rotation.forward(q), q, None),
        kernel_dtype=mx.float32,
        merge_q=True,
    )


joint_call = joint_glue(_plan_joint)
