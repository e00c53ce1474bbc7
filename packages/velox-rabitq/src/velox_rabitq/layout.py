"""RaBitQ keys with centroids as the decode kernels read them: affine codes in centroid blocks.

A RaBitQ score with centroids is ``<q, c_b> + <q', scale * u + zero>`` for the token's block
``b`` (:mod:`velox_rabitq.kernels`): the affine part is velox-core's
:class:`~velox_core.kernels.records.AffineCodes`, and the centroid term is constant over each
block of ``block`` tokens. :class:`BlockCodes` carries both; its layout
(:class:`BlocksLayout`) brings a kernel of its own (:meth:`BlocksLayout.own_kernel`): velox-core's
tensor-core or portable decode kernel over the affine codes with **one split per centroid
block**, each split's max raised by its block's ``<q', R c_b>`` (the rotation is orthogonal, so
this is ``<q, c_b>``) before velox-core's merge joins the splits: with ``s_t + b`` for every
token of a split, ``exp(s_t + b - (m + b)) = exp(s_t - m)``, so ``o`` and ``l`` stand and
``m + b`` is the split's max, exactly.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import mlx.core as mx

from velox_core import kernels as _vk  # backend() looked up per call (tests report another)
from velox_core.kernels.layout import LOG2E, Layout, check_codes, pad_rows, register_layout
from velox_core.kernels.mma import mma_launch, mma_supported, plan_mma
from velox_core.kernels.mma_support import mma_enabled
from velox_core.kernels.portable import fit_splits, plan_for, plan_portable
from velox_core.kernels.records import AffineCodes, CodeRecord

__all__ = ["BLOCKS", "BlockCodes", "BlocksLayout", "block_parts"]

BLOCKS = 6  # the layout's kind (it never reaches the portable kernel's template: own kernel)


@dataclass(slots=True, kw_only=True)
class BlockCodes(CodeRecord):
    """RaBitQ keys with centroids: affine codes and one centroid per block of tokens.

    Attributes:
        affine: the codes as affine keys of one group of the whole head.
        centroids: ``(B, H, D, T / block)`` float32, each block's centroid in the rotated
            domain (a column a block).
        block: tokens per centroid.
    """

    kind: ClassVar[int] = BLOCKS
    affine: AffineCodes
    centroids: mx.array
    block: int

    @property
    def codes(self) -> mx.array:
        return self.affine.codes

    @property
    def bits(self) -> int:
        return self.affine.bits

    @property
    def group(self) -> int:
        return self.affine.group

    @property
    def a(self) -> mx.array:
        return self.affine.scale

    @property
    def b(self) -> mx.array:
        return self.affine.zero


def _tensor_core_blocks(q_shape, keys: AffineCodes, values, block, scale):
    """The tensor-core kernel's per-split launch with one split per centroid block (the
    rotated query: float32), or None where it does not take the shape or its tiles
    (``16 x NSUB`` tokens, a split's span rounded up to them) do not divide the block."""
    b, h, m, dim = q_shape
    if not (_vk.backend() == "cuda" and mma_enabled()):
        return None
    if not mma_supported(m, dim, keys, values):
        return None
    t = keys.codes.shape[2]
    nblk = t // block
    launch = mma_launch(q_shape, mx.float32, keys, values, nblk, scale)
    if launch is None or launch.splits != nblk or block % (16 * dict(launch.template)["NSUB"]):
        return None
    check_codes("key", keys, b, h, t, dim)
    check_codes("value", values, b, h, t, dim)
    return plan_mma(q_shape, mx.float32, keys, values, nblk, scale)


def _portable_blocks(q_shape, keys: AffineCodes, values, block, scale):
    """The portable kernel's launch with one split per centroid block, or None where it has
    no layout for the shape or a block exceeds a split's ``max_span`` tokens."""
    _, _, m, dim = q_shape
    p = plan_for(m, dim, keys, values)
    if p is None or block > p.max_span:
        return None
    t = keys.codes.shape[2]
    nblk = t // block
    if fit_splits(t, nblk, p) != nblk:  # (each split is then exactly one block)
        return None
    return plan_portable(q_shape, keys, values, nblk, scale)


def block_parts(q_shape, keys: AffineCodes, values: CodeRecord, block: int, scale=None):
    """The decode kernel over affine keys with one split per block of ``block`` tokens, as
    ``parts(q) -> (o_part, ml_part, q padded)``: the tensor-core kernel where it takes them,
    else the portable one; None where neither does."""
    parts = _tensor_core_blocks(q_shape, keys, values, block, scale)
    return parts if parts is not None else _portable_blocks(q_shape, keys, values, block, scale)


def _centroid_bias(q: mx.array, ct: mx.array, factor: float) -> mx.array:
    """``factor <q, c>`` for every query row and centroid block, float32, as the kernels' max
    scores take it (log2 units). A GPU runs float32 matmuls in TF32 (10-bit mantissas) unless
    ``MLX_ENABLE_TF32=0``, so both factors are split into bfloat16 parts (exact in TF32):
    ``q_hi C_hi + q_lo C_hi + q_hi C_lo`` is the float32 product to about ``2^-17``.

    Shapes:
        q ``(B, H, R, D)``; ct ``(B, H, D, T / block)`` float32; returns
        ``(B, H, T / block, R, 1)``, the layout of a split's max in ``ml_part``.
    """
    qf = q.astype(mx.float32)
    q_hi = qf.astype(mx.bfloat16).astype(mx.float32)
    c_hi = ct.astype(mx.bfloat16).astype(mx.float32)
    qc = (q_hi @ c_hi + (qf - q_hi) @ c_hi + q_hi @ (ct - c_hi)) * factor  # (B, H, R, S)
    return mx.swapaxes(qc, 2, 3)[..., None]


class BlocksLayout(Layout):
    """How the decode kernels read :class:`BlockCodes`: by a kernel of the layout's own
    (:meth:`own_kernel`), keys only."""

    kind = BLOCKS
    record = BlockCodes
    name = "rabitq-blocks"
    keys_only = True
    mixes_values = False
    package = "velox_rabitq"

    def lanes_ok(self, bits, group, dim, cpl):
        return False  # never the portable kernel's own passes

    def own_kernel(self, q_shape, keys, values, splits, scale):
        parts = block_parts(q_shape, keys.affine, values, keys.block, scale)
        if parts is None:
            raise ValueError(
                "decode_attention: no decode kernel takes these RaBitQ centroid blocks "
                f"({keys.block} tokens) for query rows {q_shape[2]} (block_parts)"
            )
        factor = LOG2E * (1.0 if scale is None else float(scale))

        def run(q, q_side=None):
            o_part, ml_part, qk = parts(q)
            bias = _centroid_bias(pad_rows(q, o_part.shape[3]), keys.centroids, factor)
            return o_part, ml_part + mx.pad(bias, [(0, 0)] * 4 + [(0, 1)]), qk

        return run


register_layout(BlocksLayout())
