"""The code layouts the decode kernels read: one typed record per layout of a coded side.

A segment's keys and values are each one record: :class:`AffineCodes` (per-token groups,
``x = scale * code + zero``), :class:`ChannelAffineCodes` (KIVI's per-channel keys),
:class:`CodebookCodes` (``x = norm * levels[code]``), or a record class a method package
defines for a layout of its own (vector codes, a codeword per sub-vector, among them). Each
carries its layout as the class constant ``kind`` (:data:`AFFINE`, :data:`AFFINE_CHANNEL`,
:data:`CODEBOOK`: the kernels' ``KKIND`` / ``VKIND``;
:mod:`velox_core.kernels.layout` says how the kernels read each), is built by keyword and
checks its widths and the presence of its arrays when built (no device work: shapes are
checked against the query's head dim by :func:`velox_core.kernels.layout.check_codes`).
:class:`CodeRecord` is their base, for type hints and isinstance checks, and gives the kernels
one read-only view of every record.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

import mlx.core as mx

AFFINE, CODEBOOK, AFFINE_CHANNEL = 0, 1, 2  # other kinds: method packages' layouts

__all__ = [
    "AFFINE",
    "CODEBOOK",
    "AffineCodes",
    "ChannelAffineCodes",
    "CodeRecord",
    "CodebookCodes",
    "check_record",
]


class CodeRecord:
    """One side (keys or values) of a coded segment as the decode kernels read it: the base of
    the typed records (:class:`AffineCodes`, :class:`ChannelAffineCodes`,
    :class:`CodebookCodes`, and the records method packages define).

    The kernel builders read every record through one view: ``kind`` (the record class's
    layout constant), ``bits``, ``group``, ``codes``, ``a`` (the scales or norms), ``b`` (the
    zeros, the outlier norms or the positions; None where the layout has none), ``levels``
    (codebook levels, or a vector layout's codebooks), ``signs`` and ``rnorm`` (a codebook's
    residual sketch) and ``symmetric``. Each record maps them to its named fields; the parts
    a layout lacks are this base's class attributes (None, ``symmetric`` False), read-only on
    the records.
    """

    __slots__ = ()

    kind: ClassVar[int]
    levels: ClassVar[mx.array | None] = None
    signs: ClassVar[mx.array | None] = None
    rnorm: ClassVar[mx.array | None] = None
    symmetric: ClassVar[bool] = False

    @property
    def a(self) -> mx.array:
        """The kernels' ``ka`` / ``va``: the scales or norms."""
        raise NotImplementedError

    @property
    def b(self) -> mx.array | None:
        """The kernels' ``kb`` / ``vb``: the zeros, outlier norms or positions, or None."""
        return None


def check_record(
    rec: CodeRecord, arrays: tuple[str, ...], width: bool = True, group: str = "group"
) -> None:
    """The construction checks the records share, a method package's records included
    (host-side only, no device work): ``bits``
    an int from 1 to 8 (``width``), the field named ``group`` a positive int, each of
    ``arrays`` an ``mx.array``."""
    name = type(rec).__name__
    if width and (type(rec.bits) is not int or not 1 <= rec.bits <= 8):
        raise ValueError(f"{name}: bits must be an int from 1 to 8, got {rec.bits!r}")
    g = getattr(rec, group)
    if type(g) is not int or g < 1:
        raise ValueError(f"{name}: {group} must be a positive int, got {g!r}")
    for n in arrays:
        x = getattr(rec, n)
        if not isinstance(x, mx.array):
            if x is None:
                raise ValueError(f"{name}: {n} is required (got None)")
            raise TypeError(f"{name}: {n} must be an mx.array, got {type(x).__name__}")


# The records are not frozen: a decode step may build two of them per layer, and a frozen
# dataclass's __init__ (object.__setattr__ per field) costs several times a plain one's; treat
# them as immutable (dataclasses.replace makes a changed copy, checked again).
# A required field named like a view attribute of CodeRecord (levels) is
# declared with field(): a bare annotation would take the base's class attribute as default.


@dataclass(slots=True, kw_only=True)
class _Affine(CodeRecord):
    """The fields of both affine layouts, ``x = scale * code + zero``, one (scale, zero) a
    group (:class:`AffineCodes`, :class:`ChannelAffineCodes` say along which axis). The view's
    ``a`` and ``b`` are the scale and zero themselves, set when built (a plan reads them as
    attributes)."""

    bits: int
    group: int
    codes: mx.array
    scale: mx.array
    zero: mx.array
    a: mx.array = field(init=False, repr=False, compare=False)
    b: mx.array = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        check_record(self, ("codes", "scale", "zero"))
        self.a, self.b = self.scale, self.zero


@dataclass(slots=True, kw_only=True)
class AffineCodes(_Affine):
    """Affine codes in groups of a token's channels, ``x = scale * code + zero``:
    :class:`velox_core.Uniform` with ``axis="token"``, and RaBitQ's keys (one group of the
    whole head).

    Attributes:
        bits: code width, 1 to 8.
        group: channels per (scale, zero).
        codes: ``(B, H, T, ceil(D * bits / 32))`` uint32 packed codes (velox's packing).
        scale: ``(B, H, T, D / group)``.
        zero: shaped like ``scale``.
    """

    kind: ClassVar[int] = AFFINE


@dataclass(slots=True, kw_only=True)
class ChannelAffineCodes(_Affine):
    """Affine codes with one (scale, zero) per channel for each group of tokens (keys only:
    KIVI's keys, :class:`velox_core.Uniform` with ``axis="channel"``).

    Attributes:
        bits: code width, 1 to 8.
        group: tokens per scale row (a segment holds whole groups).
        codes: ``(B, H, T, ceil(D * bits / 32))`` uint32 packed codes.
        scale: ``(B, H, T / group, D)``.
        zero: shaped like ``scale``.
    """

    kind: ClassVar[int] = AFFINE_CHANNEL


@dataclass(slots=True, kw_only=True)
class CodebookCodes(CodeRecord):
    """Codebook codes, ``x = norm * levels[code]`` with one norm a token (a rotated
    domain's Lloyd-Max levels), keys optionally with a residual sign sketch.

    Attributes:
        bits: code width, 1 to 8.
        dim: the head dim, the channels one norm covers (the kernels' group of a codebook
            side; the tensor-core kernel requires it to be the head dim).
        codes: ``(B, H, T, ceil(D * bits / 32))`` uint32 packed codes.
        norm: ``(B, H, T)``.
        levels: ``(2**bits,)`` float32 levels.
        symmetric: the caller vouches that the levels are ascending and
            ``levels[2**bits - 1 - c] == -levels[c]`` in fp16 (Lloyd-Max levels of a law
            symmetric about 0, checked on the host once per codebook:
            :func:`velox_core.kernels.layout.levels_symmetric`); the tensor-core kernel then
            looks 4-bit codes up in half the table and forms 2-bit ones without a permute
            (``KCB`` / ``VCB`` 2). False: any levels.
        signs: keys with a residual sign sketch: ``(B, H, T, D/32)`` uint32,
            bit ``e`` set where channel ``e`` of the residual's sketch is positive; the caller
            passes the sketched query to ``decode_attention``. None otherwise.
        rnorm: with ``signs`` (and only with them): the residual norms ``(B, H, T)``.
    """

    kind: ClassVar[int] = CODEBOOK
    bits: int
    dim: int
    codes: mx.array
    norm: mx.array
    levels: mx.array = field()
    symmetric: bool = False
    signs: mx.array | None = None
    rnorm: mx.array | None = None

    def __post_init__(self) -> None:
        if self.signs is None and self.rnorm is None:
            check_record(self, ("codes", "norm", "levels"), group="dim")
        elif self.signs is None or self.rnorm is None:
            raise ValueError("CodebookCodes: signs and rnorm go together (a residual sketch)")
        else:
            check_record(self, ("codes", "norm", "levels", "signs", "rnorm"), group="dim")

    @property
    def group(self) -> int:
        """The kernels' group of a codebook side: the head dim (one norm a token)."""
        return self.dim

    @property
    def a(self) -> mx.array:
        return self.norm
