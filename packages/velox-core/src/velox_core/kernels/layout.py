"""The seam between code records and the decode kernels: one :class:`Layout` per record class.

A :class:`Layout` says how the portable decode kernel (``metal/decode_attention.metal``)
reads one record class of :mod:`velox_core.kernels.records`: its ``KKIND`` / ``VKIND``
value, which lane layouts it takes (:meth:`Layout.lanes_ok`), its four inputs per side
(:meth:`Layout.inputs`), the per-call query-side input its keys need (:meth:`Layout.query_shape`,
:meth:`Layout.query_inputs`), its shape checks (:meth:`Layout.check`), its template
constants, and, for a layout whose keys are scored by code of its own, the key pass it
brings into the kernel (:attr:`Layout.key_pass`, a file its package ships). The layouts live
in a registry keyed by record class and by kind (:func:`register_layout`, :func:`layout_of`,
:func:`layout_for`): the kernels' host code looks a record's layout up instead of branching
on its kind.

velox-core registers the layouts of its own records (:class:`AffineLayout`,
:class:`ChannelAffineLayout`, :class:`CodebookLayout`). A method package with a layout of
its own defines its record class (a :class:`~velox_core.kernels.records.CodeRecord`), a
:class:`Layout` subclass and, where its keys need their own scoring, the key pass; it
registers the layout when its kernel module is imported. See docs/contributing.md.

Through the layouts, the kernels' host code gets what it takes from a record here: its
inputs (:func:`code_inputs`, :func:`sketch_inputs`), its shape checks against the query's
head dim (:func:`check_codes`), and the template values every kernel shares
(:func:`qmul_bits`, :func:`float_bits`, :data:`FP16_MAX`; :func:`levels_symmetric`, the host
check of a codebook's symmetry).

**The key pass contract.** A key pass is a block of kernel body text (Metal, compiled for
CUDA as well through ``velox_kernels.h``) placed where the portable kernel scores a split's
tokens, run when the template constant ``KOWN`` is 1. It reads the kernel's names: the split
``[t0, t1)``, ``STEP``, ``UNROLL``, ``TPW``, ``LPT``, ``LPT_REAL``, ``CPL``, ``MB``, ``HD``,
``NWARPS``, ``KBITS``, ``KGROUP``, ``KMASK``, ``QMUL``; the lane's ``tid``, ``lane``,
``warp``, ``slot``, ``j``, ``jc``, ``act``; the row ``b``, ``h``, ``mblk``; the inputs
``kc``, ``ka``, ``kb`` and the query-side ``ksg``, ``krn``, ``qsk``, ``kix``, ``kst`` with
their strides; ``klv_s``, the ``KOLV`` floats of ``klv`` the kernel copies to threadgroup
memory first. For each token it computes the score of each of its rows in the log2 domain
(times ``QMUL``), adds up the token's lanes' sums (``vx_reduce_scatter<MB, LPT>``, or a
butterfly where the layout sets :attr:`Layout.butterfly`), keeps the running max in ``wmax``
and writes ``smem[(tok - t0) * MB + srow + e]`` (``e < SRN``) on the lanes ``j < SRL``, as
the kernel's own pass does. Its own template constants come from :meth:`Layout.constants`;
splits start on whole blocks of :meth:`Layout.split_block` tokens, and
:meth:`Layout.key_rows` caps the query rows a pass holds.
"""

from __future__ import annotations

import struct
from typing import ClassVar

import mlx.core as mx
import numpy as np

from .records import (
    AFFINE,
    AFFINE_CHANNEL,
    CODEBOOK,
    AffineCodes,
    ChannelAffineCodes,
    CodebookCodes,
    CodeRecord,
)

__all__ = [
    "FP16_MAX",
    "LOG2E",
    "Layout",
    "check_codes",
    "code_inputs",
    "device_floats",
    "float_bits",
    "layout_of",
    "levels_symmetric",
    "pad_rows",
    "qmul_bits",
    "register_layout",
    "sketch_inputs",
    "unused_input",
]

FP16_MAX = 2048  # most fp16 tokens (sinks + window) the fused merge takes

LOG2E = 1.4426950408889634

_DUMMY: dict[mx.Dtype, mx.array] = {}


def unused_input(dtype: mx.Dtype) -> mx.array:
    """An unused 8-element input (kept at 8 so Metal passes it in device memory)."""
    hit = _DUMMY.get(dtype)
    if hit is None:
        hit = _DUMMY[dtype] = mx.zeros((8,), dtype=dtype)
    return hit


def device_floats(x: mx.array) -> mx.array:
    """A 1-D float32 input padded to 8 elements at least: kept in device memory on Metal
    (MLX passes smaller inputs as constants; the body only indexes it)."""
    if x.size < 8:
        return mx.concatenate([x, mx.zeros((8 - x.size,), mx.float32)])
    return x


def pad_rows(x: mx.array, rows: int) -> mx.array:
    """``x (B, H, R, D)`` with zero rows appended up to ``rows``."""
    b, h, r, d = x.shape
    return x if rows <= r else mx.concatenate([x, mx.zeros((b, h, rows - r, d), x.dtype)], axis=2)


def _placeholders() -> list[mx.array]:
    """The portable kernel's five query-side inputs where a side takes none."""
    u32, f16, f32 = unused_input(mx.uint32), unused_input(mx.float16), unused_input(mx.float32)
    return [u32, f16, f32, u32, f32]


class Layout:
    """How the portable decode kernel reads one record class: the base of the layouts.

    Class attributes:
        kind: the record's ``KKIND`` / ``VKIND`` value (unique among registered layouts).
        record: the :class:`CodeRecord` subclass it reads.
        name: a short name (messages, ``KernelConfig.layouts_off``).
        keys_only: the layout's records are keys by construction (given as values: an
            error).
        mixes_values: the kernel's value pass reads the layout (False: a segment with such
            values takes the reference path).
        wide: the layout may take CUDA's wider register budget at 32 channels a lane.
        key_pass: the file of the key pass this layout brings into the portable kernel
            (see the module's contract), shipped by ``package``; None: the kernel's own
            passes read it.
        package: the package whose ``metal/`` folder ships ``key_pass``.
        butterfly: the key pass adds a token's lanes' sums by a butterfly (every lane ends
            with every row, ``KFLY``) rather than a reduce-scatter.
    """

    kind: ClassVar[int]
    record: ClassVar[type[CodeRecord]]
    name: ClassVar[str]
    keys_only: ClassVar[bool] = False
    mixes_values: ClassVar[bool] = True
    wide: ClassVar[bool] = True
    key_pass: ClassVar[str | None] = None
    package: ClassVar[str] = "velox_core"
    butterfly: ClassVar[bool] = False

    def lanes_ok(self, bits: int, group: int, dim: int, cpl: int) -> bool:
        """Whether a lane of ``cpl`` channels reads a side of this layout (``bits``,
        ``group``) of a ``dim``-channel head."""
        raise NotImplementedError

    def inputs(self, c: CodeRecord) -> tuple[mx.array, mx.array, mx.array, mx.array]:
        """The side's four inputs (``kc, ka, kb, klv`` or ``vc, va, vb, vlv``)."""
        raise NotImplementedError

    def check(self, name: str, c: CodeRecord, b: int, h: int, t: int, dim: int) -> None:
        """Shapes and dtypes of ``c`` (``name``: ``"key"`` or ``"value"``) against a
        ``(B, H, T)`` segment of head dim ``dim``; raises ValueError naming what is wrong."""
        raise NotImplementedError

    def query_shape(
        self, c: CodeRecord, b: int, h: int, m: int, dim: int
    ) -> tuple[int, ...] | None:
        """The shape of the per-call query-side input these keys take (a sketched query,
        query tables), or None where they take none."""
        return None

    def query_inputs(self, c: CodeRecord, q_side: mx.array | None, rows: int) -> list[mx.array]:
        """The kernel's five query-side inputs (``ksg, krn, qsk, kix, kst``) for keys ``c``
        and their query-side input (rows padded to ``rows``); placeholders by default."""
        return _placeholders()

    def group_constant(self, c: CodeRecord, dim: int) -> int:
        """The ``KGROUP`` / ``VGROUP`` template value."""
        return c.group

    def table_floats(self, c: CodeRecord, dim: int) -> int:
        """``KOLV``: floats of the keys' ``klv`` input that a key pass reads from
        threadgroup memory (0: none)."""
        return 0

    def constants(self, c: CodeRecord, dim: int) -> list[tuple[str, int]]:
        """The template constants of this layout's key pass (keys only)."""
        return []

    def key_rows(self, c: CodeRecord, dim: int) -> int | None:
        """The most query rows one pass of these keys holds (its registers), or None for
        the kernel's own rule; 0 declines the segment."""
        return None

    def split_block(self, c: CodeRecord) -> int:
        """Tokens a split holds whole (``KSPAN``: the kernel rounds a split's span up to
        them); 1 for any split."""
        return 1

    def query_token_inputs(self, c: CodeRecord) -> tuple[int, ...]:
        """Which of the five query-side inputs (:meth:`query_inputs`) run along the tokens
        (so may be slices of a longer buffer; the emulator's strided checks use it)."""
        return ()

    def own_kernel(
        self,
        q_shape: tuple[int, int, int, int],
        keys: CodeRecord,
        values: CodeRecord,
        splits: int | None,
        scale: float | None,
    ):
        """A kernel of the layout's own (not the portable one) for this segment, as
        ``parts(q, q_side) -> (o_part, ml_part, q)`` per-split partials; None where the
        portable kernel takes it. Raises where the records are laid out for that kernel
        and it declines them."""
        return None


_BY_RECORD: dict[type, Layout] = {}
_BY_KIND: dict[int, Layout] = {}


def register_layout(layout: Layout) -> Layout:
    """Add ``layout`` to the registry (again for the same class: a no-op). Raises ValueError
    where another layout holds its kind, its record class or its name."""
    if not isinstance(layout, Layout):
        raise TypeError(f"register_layout: expected a Layout, got {type(layout).__name__}")
    same = _BY_KIND.get(layout.kind)
    if same is not None:
        if type(same) is type(layout):
            return same
        raise ValueError(
            f"register_layout: kind {layout.kind} is {type(same).__name__}'s, not "
            f"{type(layout).__name__}'s"
        )
    if layout.record in _BY_RECORD:
        raise ValueError(f"register_layout: {layout.record.__name__} already has a layout")
    if any(other.name == layout.name for other in _BY_KIND.values()):
        raise ValueError(f"register_layout: the name {layout.name!r} is taken")
    if getattr(layout.record, "kind", None) != layout.kind:
        raise ValueError(
            f"register_layout: {layout.record.__name__}.kind must be {layout.kind}, got "
            f"{getattr(layout.record, 'kind', None)!r}"
        )
    _BY_KIND[layout.kind] = layout
    _BY_RECORD[layout.record] = layout
    return layout


def layout_of(c: CodeRecord) -> Layout:
    """The layout of record ``c``; TypeError for a record class no layout reads."""
    hit = _BY_RECORD.get(type(c))
    if hit is None:
        for cls in type(c).__mro__[1:]:
            if cls in _BY_RECORD:
                return _BY_RECORD[cls]
        raise TypeError(
            f"no decode kernel layout reads {type(c).__name__} (registered: "
            f"{', '.join(sorted(r.__name__ for r in _BY_RECORD))})"
        )
    return hit


def layout_for(kind: int) -> Layout | None:
    """The layout of ``KKIND`` / ``VKIND`` value ``kind``, or None."""
    return _BY_KIND.get(kind)


def layouts() -> tuple[Layout, ...]:
    """The registered layouts, by kind."""
    return tuple(_BY_KIND[k] for k in sorted(_BY_KIND))


def qmul_bits(scale: float | None = None) -> int:
    """The ``QMUL`` template value: the float32 bits of ``log2(e)`` (times ``scale``, for
    queries that come unscaled), the factor the tensor-core kernel and the fp16 merge apply to
    the queries."""
    return float_bits(LOG2E * (1.0 if scale is None else float(scale)))


def float_bits(x: float) -> int:
    """The float32 bits of ``x`` as a signed int (a template value)."""
    return struct.unpack("<i", struct.pack("<f", float(x)))[0]


def levels_symmetric(levels) -> bool:
    """Whether codebook ``levels`` (host values: a numpy array or a list of floats) are
    ascending and symmetric about 0 in fp16, ``fp16(L[n - 1 - c]) == -fp16(L[c])`` for every
    code ``c``: what :attr:`CodebookCodes.symmetric` vouches for. One host check per codebook;
    never on a device array in a decode step (it would wait for the device)."""
    lev = np.asarray(levels, dtype=np.float32).reshape(-1)
    with np.errstate(over="ignore"):  # past fp16's range: infinite, refused below
        half = lev.astype(np.float16)
    if lev.size < 2 or not np.all(np.isfinite(half)) or np.any(np.diff(half) < 0):
        return False
    return bool(np.array_equal(half[::-1], -half))


def code_inputs(c: CodeRecord) -> tuple[mx.array, mx.array, mx.array, mx.array]:
    """One side's four inputs of the portable kernel (``kc, ka, kb, klv`` or ``vc, va, vb,
    vlv``): its layout's (:meth:`Layout.inputs`)."""
    return layout_of(c).inputs(c)


def sketch_inputs(keys: CodeRecord, q_sketch: mx.array | None, rows: int) -> list[mx.array]:
    """The portable kernel's last five inputs (``ksg, krn, qsk, kix, kst``): the keys'
    query-side inputs (:meth:`Layout.query_inputs`; the sketched
    query or query tables padded to ``rows``), placeholders where the keys take none."""
    return layout_of(keys).query_inputs(keys, q_sketch, rows)


def check_codes(name: str, c: CodeRecord, b: int, h: int, t: int, dim: int) -> None:
    """Shapes and dtypes of one side's record (``name``: ``"key"`` or ``"value"``) against a
    ``(B, H, T)`` segment of head dim ``dim`` (:meth:`Layout.check`);
    a keys-only layout is refused as values. What the record's construction checked (widths,
    its arrays present) is not checked again."""
    lay = layout_of(c)
    if name != "key" and lay.keys_only:
        raise ValueError(f"decode_attention: {lay.name} codes are for keys only")
    lay.check(name, c, b, h, t, dim)


def _check_words(name: str, c: CodeRecord, b: int, h: int, t: int, words: int) -> None:
    if tuple(c.codes.shape) != (b, h, t, words) or c.codes.dtype != mx.uint32:
        raise ValueError(
            f"decode_attention: {name} codes {tuple(c.codes.shape)} {c.codes.dtype} do not match "
            f"(B, H, T, W) = {(b, h, t, words)} uint32"
        )


def _whole_words(bits: int, cpl: int) -> bool:
    return 1 <= bits <= 8 and (cpl * bits) % 32 == 0


class AffineLayout(Layout):
    """:class:`AffineCodes`: ``x = scale * code + zero`` per group of a token's channels."""

    kind = AFFINE
    record = AffineCodes
    name = "affine"

    def lanes_ok(self, bits, group, dim, cpl):
        if not _whole_words(bits, cpl):
            return False
        return group >= 1 and dim % group == 0 and (group % cpl == 0 or cpl % group == 0)

    def inputs(self, c):
        return c.codes, c.scale, c.zero, unused_input(mx.float32)

    def _scale_shape(self, name, c, b, h, t, dim):
        return (b, h, t, dim // c.group)

    def check(self, name, c, b, h, t, dim):
        _check_words(name, c, b, h, t, -(-dim * c.bits // 32))
        want = self._scale_shape(name, c, b, h, t, dim)
        if tuple(c.scale.shape) != want or tuple(c.zero.shape) != want:
            raise ValueError(f"decode_attention: {name} scales/norms do not have shape {want}")


class ChannelAffineLayout(AffineLayout):
    """:class:`ChannelAffineCodes`: one (scale, zero) per channel and group of tokens (keys
    only, KIVI's)."""

    kind = AFFINE_CHANNEL
    record = ChannelAffineCodes
    name = "affine_channel"
    mixes_values = False

    def lanes_ok(self, bits, group, dim, cpl):
        return _whole_words(bits, cpl) and group >= 1

    def _scale_shape(self, name, c, b, h, t, dim):
        if t % c.group:
            raise ValueError(
                f"decode_attention: {name} tokens ({t}) must be whole groups of {c.group} for "
                "per-channel scales"
            )
        return (b, h, t // c.group, dim)


class CodebookLayout(Layout):
    """:class:`CodebookCodes`: ``x = norm * levels[code]``, keys optionally with a residual
    sign sketch (their query-side input: the sketched query)."""

    kind = CODEBOOK
    record = CodebookCodes
    name = "codebook"

    def lanes_ok(self, bits, group, dim, cpl):
        return _whole_words(bits, cpl)

    def inputs(self, c):
        levels = device_floats(c.levels.astype(mx.float32))
        return c.codes, c.norm, unused_input(c.norm.dtype), levels

    def check(self, name, c, b, h, t, dim):
        if c.dim != dim:
            raise ValueError(
                f"decode_attention: {name} codebook codes are for head dim {c.dim}, the "
                f"segment's is {dim}"
            )
        if c.signs is not None:
            if tuple(c.signs.shape) != (b, h, t, dim // 32) or c.signs.dtype != mx.uint32:
                raise ValueError(
                    f"decode_attention: {name} signs {tuple(c.signs.shape)} {c.signs.dtype} do "
                    f"not match (B, H, T, D/32) = {(b, h, t, dim // 32)} uint32"
                )
            if tuple(c.rnorm.shape) != (b, h, t):
                raise ValueError(f"decode_attention: {name} rnorm does not have shape {(b, h, t)}")
        _check_words(name, c, b, h, t, -(-dim * c.bits // 32))
        if tuple(c.norm.shape) != (b, h, t):
            raise ValueError(f"decode_attention: {name} scales/norms do not have shape {(b, h, t)}")

    def group_constant(self, c, dim):
        return dim

    def query_shape(self, c, b, h, m, dim):
        return None if c.signs is None else (b, h, m, dim)

    def query_token_inputs(self, c):
        return () if c.signs is None else (0, 1)  # the signs and the residual norms

    def query_inputs(self, c, q_side, rows):
        if c.signs is None:
            return _placeholders()
        u32, f32 = unused_input(mx.uint32), unused_input(mx.float32)
        return [c.signs, c.rnorm, pad_rows(q_side.astype(mx.float32), rows), u32, f32]


for _layout in (AffineLayout, ChannelAffineLayout, CodebookLayout):
    register_layout(_layout())
del _layout
