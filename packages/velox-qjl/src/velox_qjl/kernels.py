"""GPU kernel path of QJL keys: fused decode attention over the sign sketches.

On NVIDIA GPUs, segments whose sketches are whole 32-bit words (the paper's setting and the
recommended keys among them; :func:`velox_qjl.sketch_mma.supported`) take this package's
tensor-core sketch kernel (``metal/decode_attention_sketch_mma.cu``): the signs as fp16 ``+-1`` MMA
operands, each outlier block's ``S P q`` by MMAs, ``S`` and ``S q`` in that kernel's order
(:meth:`velox_qjl.QJL.kernel_matrix` with ``lanes`` 0). Everywhere else, velox-core's
portable decode kernel (``metal/decode_attention.metal``) reads QJL keys as *sketch* codes
(:class:`velox_qjl.layout.SketchCodes`) with this package's key pass
(``metal/decode_sketch_keys.metal``): it reads each key's packed sign bits,
norms and, per block of ``group`` tokens, the outlier channels' indices and their own sketch,
and scores them against the sketched query without unpacking anything to float:

* ``S`` is kept a second time, transposed with its rows in the kernel's lane order
  (:meth:`velox_qjl.QJL.kernel_matrix`: as many bytes as the projection, counted with it), so
  that a warp reads contiguous runs of it;
* the host computes ``S q`` once per call (MLX matmuls, split so that a GPU's TF32 products
  keep float32 precision: :func:`_query_sketch`);
* the kernel forms ``S P q`` per block (the query's outlier coordinates times the matching
  columns of ``S``: ``outliers`` multiply-adds per sign bit and block), and adds
  ``c/m ||k_in|| <S q - S P q, sign(S k_in)> + c/m_o ||k_o|| <S P q, sign(S k_o)>`` per token,
  the reference's estimator term for term;
* values are mixed from their per-token ``Uniform`` codes in the same pass, and the splits
  merged (with a cache's fp16 window and sinks in one softmax).

The codec gives the kernels its key side (:func:`kernel_keys`); where the kernel does not
apply (kernels off or the CPU, values not per-token ``Uniform``, a sketch size the key pass
does not lay out: see :func:`velox_qjl.layout.sketch_lanes`) the caller takes the reference
path.

Encoding (:func:`encode_sketch`): the outlier channels of each block stay MLX ops (energies,
``argpartition``, sort: :func:`velox_qjl.projection.top_channels`), then one launch of
velox-core's sketch encode kernel (``metal/encode_sketch.metal``) writes both packed sign
sketches and both norms, one thread per output word.
"""

from __future__ import annotations

import mlx.core as mx

from velox_core import Codec, Packed
from velox_core.kernels import portable as kport
from velox_core.kernels import use_kernels
from velox_core.kernels.encode import sketch_encode
from velox_core.kernels.joint import KernelSide
from velox_core.kernels.records import AFFINE, AffineCodes, CodeRecord

from . import sketch_mma as _sm
from .layout import SKETCH, SketchCodes, SketchKeys, sketch_lanes, sketch_rows
from .projection import index_bits

__all__ = ["encode_sketch", "kernel_keys"]


# most (batch x head x token) rows the sketch encode kernel takes: on an H200 it beat the
# matmul reference for a 32-token block (1 x 8 heads: 0.219 against 0.468 ms; 8 x 8 heads:
# 0.344 against 0.429) and lost on a prompt (1 x 8 x 16,384 tokens: 8.88 against 4.98 ms,
# the reference's matmuls on tensor cores); the crossover between was not measured
ENCODE_KERNEL_ROWS = 4096


def encode_sketch(codec: Codec, x: mx.array, idx: mx.array | None) -> dict[str, mx.array] | None:
    """The record's sketches and norms of keys ``x`` in one launch of the sketch encode
    kernel (``metal/encode_sketch.metal``), or None where kernels do not run (kernels off or
    the CPU), the kernel declines, or ``x`` holds more than :data:`ENCODE_KERNEL_ROWS`
    (batch x head x token) rows (a prompt: the matmul path is faster there).

    Shapes:
        x ``(B, H, T, D)`` (the codec bound to ``D``); idx ``(B, H, T // group, k)`` int32,
        each block's outlier channels sorted ascending (``top_channels``), or None without
        outliers. Returns ``{"osign", "onorm"}`` (with outliers) and ``{"sign", "norm"}``
        as :meth:`velox_qjl.QJL.encode` records them (without ``idx``).
    """
    if not use_kernels() or codec.dim is None:
        return None
    if x.size // x.shape[-1] > ENCODE_KERNEL_ROWS:  # bulk (a prompt): the matmul path
        return None
    m, _, mo = codec.sizes(codec.dim)
    if idx is None:
        got = sketch_encode(x, codec.proj, m)
    else:
        got = sketch_encode(x, codec.proj, m, idx, mo, codec.group)
    if got is None:
        return None
    sign, norm, osign, onorm = got
    out = {} if idx is None else {"osign": osign, "onorm": onorm}
    return {**out, "sign": sign, "norm": norm}


def kernel_keys(codec: Codec, packed: Packed, q_shape, values: CodeRecord) -> KernelSide | None:
    """:meth:`velox_core.Codec.kernel_keys` of QJL: the sign sketches as the decode kernels
    read them (:class:`velox_qjl.layout.SketchCodes` with its ``SketchKeys``), scored
    against the sketched query (their query-side input, :func:`_query_sketch`), for the
    query rows of ``q_shape`` beside per-token affine values; None where no kernel applies:
    values of another layout, a codec not yet bound to this head dim, or a layout the
    kernel's plan declines (``velox_core.kernels.portable.plan``), checked before the
    kernel's copy of ``S`` is made."""
    rows = q_shape[2]
    if codec.dim is None or q_shape[-1] != codec.dim or type(values) is not AffineCodes:
        return None
    m, k, mo = codec.sizes(codec.dim)
    mo = mo if k else 0
    p = packed.data
    if _sm.wanted(rows, codec.dim, m, mo, k, codec.block, p["norm"].dtype, values):
        lanes = 0  # the tensor-core sketch kernel (CUDA)
    else:
        lanes = sketch_lanes(m, mo)
        cap = sketch_rows(m, mo, k, lanes) if lanes else 0
        block = codec.block if k else 1
        plan = kport.plan(
            rows, codec.dim, SKETCH, 1, codec.block, AFFINE, values.bits, values.group, False,
            cap, block,
        )  # fmt: skip
        if plan is None:  # (before the kernel's copy of S is made)
            return None
    sk = SketchKeys(
        m=m,
        mo=mo,
        outliers=k,
        index_bits=index_bits(codec.dim),
        const=codec._const(),
        lanes=lanes,
        matrix=codec.kernel_matrix(lanes),
        osign=p["osign"] if k else None,
        idx=p["idx"] if k else None,
        mma=lanes == 0,
    )
    rec = SketchCodes(
        codes=p["sign"], norm=p["norm"], onorm=p["onorm"] if k else None, group=codec.block,
        sketch=sk,
    )  # fmt: skip
    return KernelSide(rec, query_input=lambda q: _query_sketch(rec, q))


def _query_sketch(keys: SketchCodes, q: mx.array) -> mx.array:
    """``S q`` over the main sketch's rows, in the kernel's lane order, float32.

    A GPU runs float32 matmuls in TF32 unless ``MLX_ENABLE_TF32=0`` (MLX's default on CUDA
    and on recent Apple GPUs): 10-bit mantissas. ``S`` is float16, exact in TF32, so only
    the query is split, into its bfloat16 part and the rest: ``S q_hi + S q_lo`` is exact to
    about ``2^-19`` of ``q``, as the float32 product."""
    sk = keys.sketch
    s = sk.matrix[:, : sk.m]
    qf = q.astype(mx.float32)
    hi = qf.astype(mx.bfloat16).astype(mx.float32)
    return hi @ s + (qf - hi) @ s
