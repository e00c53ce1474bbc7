"""VecInfer's code layout for velox-core's portable decode kernel: vector codes.

A side of VecInfer's codes is the index of a codeword per sub-vector of ``group`` channels,
one codebook per batch row and KV head (:class:`VQCodes`). The portable kernel reads them as
its kind :data:`VQ` (``KKIND`` / ``VKIND`` 4, keys and values): a threadgroup copies its
codebook to threadgroup memory and each lane reads whole sub-vectors (:class:`VQLayout`).
Registered with velox-core's layouts (:func:`velox_core.kernels.layout.register_layout`)
when this module is imported.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import mlx.core as mx

from velox_core.kernels.layout import Layout, device_floats, register_layout, unused_input
from velox_core.kernels.records import CodeRecord, check_record

__all__ = ["VQ", "VQ_MAX_TABLE", "VQCodes", "VQLayout"]

VQ = 4  # the kernels' KKIND / VKIND of vector codes

# most floats of one side's codebook (codewords x channels) the portable kernel keeps in
# threadgroup memory: 4 KiB a side beside the 16 KiB of scores (Metal allows 32 KiB)
VQ_MAX_TABLE = 1024


@dataclass(slots=True, kw_only=True)
class VQCodes(CodeRecord):
    """Vector codes: each sub-vector of ``group`` channels is the index of a codeword, ``x =
    codebooks[b, h, code]``, one codebook per batch row and KV head.

    Attributes:
        bits: bits of one codeword index, 1 to 8.
        group: channels per sub-vector (the portable kernel takes 1, 2, 4 or 8).
        codes: ``(B, H, T, ceil(D / group * bits / 32))`` uint32: a token's ``D / group``
            indices, ``bits`` each, in one bit stream.
        codebooks: ``(B, H, 2**bits, group)``, any float dtype: row ``code`` of ``(b, h)`` is
            the sub-vector (the kernels read it as ``levels``).
    """

    kind: ClassVar[int] = VQ
    bits: int
    group: int
    codes: mx.array
    codebooks: mx.array

    def __post_init__(self) -> None:
        check_record(self, ("codes", "codebooks"))

    @property
    def levels(self) -> mx.array:
        return self.codebooks

    @property
    def a(self) -> None:
        return None


class VQLayout(Layout):
    """:class:`VQCodes`: a codeword index per sub-vector of ``group`` channels, one codebook
    per batch row and KV head."""

    kind = VQ
    record = VQCodes
    name = "vq"
    wide = False

    def lanes_ok(self, bits, group, dim, cpl):
        return (
            1 <= bits <= 8
            and group in (1, 2, 4, 8)
            and cpl % group == 0
            and (cpl // group * bits) % 32 == 0
            and (1 << bits) * group <= VQ_MAX_TABLE
        )

    def inputs(self, c):  # indices; the codebooks (B * H tables, contiguous) in the levels' place
        table = device_floats(mx.contiguous(c.codebooks.astype(mx.float32)).reshape(-1))
        return c.codes, unused_input(mx.float16), unused_input(mx.float16), table

    def check(self, name, c, b, h, t, dim):
        if dim % c.group:
            raise ValueError(
                f"decode_attention: {name} sub-vectors of {c.group} channels do not divide the "
                f"head dim {dim}"
            )
        words = -(-(dim // c.group) * c.bits // 32)
        if tuple(c.codes.shape) != (b, h, t, words) or c.codes.dtype != mx.uint32:
            raise ValueError(
                f"decode_attention: {name} VQ codes {tuple(c.codes.shape)} {c.codes.dtype} do "
                f"not match (B, H, T, W) = {(b, h, t, words)} uint32"
            )
        want = (b, h, 1 << c.bits, c.group)
        cb = c.codebooks
        if tuple(cb.shape) != want or not mx.issubdtype(cb.dtype, mx.floating):
            raise ValueError(
                f"decode_attention: {name} codebooks are {(tuple(cb.shape), cb.dtype)}, expected "
                f"float (B, H, 2**bits, group) = {want}"
            )


register_layout(VQLayout())
