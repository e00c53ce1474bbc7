"""The portable decode kernel (``metal/decode_attention.metal``): the one Metal runs for
every code layout, and CUDA for the layouts without a tensor-core path.

:func:`plan` says whether and how a shape runs (lanes per token, query rows per pass, the
warps and unroll of :func:`tuning`); :func:`plan_for` is that plan for two code records
(:class:`~velox_core.kernels.records.CodeRecord`, read through their uniform view);
:func:`choose_splits` / :func:`block_splits` split the context so a sequence fills the GPU;
:func:`template` is the kernel's template; :func:`plan_portable` works all of it out once per
shape and returns the launch. A decode plan made from a cache passes the configuration it
was made under (``settings``); other callers leave it to be read.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import mlx.core as mx

from .. import kernels as _kernels  # backend() looked up per call (tests report another)
from .build import KernelSpec
from .config import KernelConfig, kernel_config
from .layout import (
    Layout,
    check_codes,
    code_inputs,
    layout_for,
    layout_of,
    qmul_bits,
    sketch_inputs,
)
from .records import CODEBOOK, CodeRecord

__all__ = [
    "MAX_REGS",
    "block_splits",
    "choose_splits",
    "decode_spec",
    "fit_splits",
    "plan",
    "plan_for",
    "plan_portable",
    "template",
]

MAX_REGS = 64  # query rows x channels per lane held in registers (and as many accumulators)

# the same on CUDA for lanes of 32 channels (3-, 5- and 7-bit codes): 4 query rows a pass, where
# 64 would take 2 and read the codes twice; 208-247 registers, no spills (nvcc sm_90a)
CUDA_WIDE_REGS = 128

SCORE_SLOTS = 4096  # (token, row) scores a threadgroup keeps (16 KiB): a split's tokens <= 4096/mb

MAX_MERGE_FLOATS = 4096  # the warp merge (nwarps x mb x head dim floats) reuses those 16 KiB

DEFAULT_BLOCKS = 1024  # threadgroups to aim for (several waves on a large GPU)

MIN_SPAN = 256  # fewest tokens per split (unless the context is shorter)

DECODE = KernelSpec(
    name="velox_decode_attention",
    source="decode_attention.metal",
    inputs=(
        *("q", "kc", "ka", "kb", "klv", "vc", "va", "vb", "vlv"),
        *("ksg", "krn", "qsk", "kix", "kst"),
    ),
    outputs=("o_part", "ml_part"),
    row_contiguous=False,  # the body reads strides: slices of a cache buffer are not copied
)


KEY_PASS = "// @key-pass"  # where the body takes a layout's own key pass (KOWN)

_SPECS: dict[type, KernelSpec] = {}


def decode_spec(keys: CodeRecord) -> KernelSpec:
    """The portable kernel for ``keys``: :data:`DECODE`, or for a layout that brings its own
    key pass (:attr:`~velox_core.kernels.layout.Layout.key_pass`) the body with that pass in
    place, named after the layout (MLX keeps compiled kernels by name)."""
    lay: Layout = layout_of(keys)
    if lay.key_pass is None:
        return DECODE
    spec = _SPECS.get(type(lay))
    if spec is None:
        spec = _SPECS[type(lay)] = dataclasses.replace(
            DECODE,
            name=f"{DECODE.name}_{lay.name}",
            inserts=((KEY_PASS, lay.key_pass, lay.package),),
        )
    return spec


@dataclass(frozen=True)
class Plan:
    """How the kernel lays out one shape (all compile-time constants of the body).

    Attributes:
        cpl: channels per lane; a token's row is spread over ``lanes = D / cpl`` lanes.
        mb: query rows per threadgroup (``nmb`` blocks of them cover the ``M`` rows).
        nmb: query-row blocks (grid z).
        lanes: lanes per token, a power of two (``D / cpl`` rounded up).
        nwarps: warps per threadgroup.
        unroll: tokens per lane per loop iteration.
        step: tokens a threadgroup consumes per loop iteration.
        max_span: most tokens one split may hold (its scores stay in threadgroup memory).
    """

    cpl: int
    mb: int
    nmb: int
    lanes: int
    nwarps: int
    unroll: int
    step: int
    max_span: int


def _pow2_ceil(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def side_ok(kind: int, bits: int, group: int, dim: int, cpl: int) -> bool:
    """Whether lanes of ``cpl`` channels read a side of layout ``kind`` (its
    :meth:`~velox_core.kernels.layout.Layout.lanes_ok`; False for a kind no layout has)."""
    lay = layout_for(kind)
    return lay is not None and lay.lanes_ok(bits, group, dim, cpl)


def _pow2_floor(n: int) -> int:
    return 1 << (max(1, n).bit_length() - 1)


def tuning(settings: KernelConfig | None = None) -> tuple[int, int]:
    """``(warps per threadgroup, unroll)``: the defaults, or ``KernelConfig.decode_warps`` and
    ``KernelConfig.decode_unroll`` (for tuning on a new GPU) of ``settings`` (default: the
    configuration in force)."""
    cfg = settings or kernel_config()
    return cfg.decode_warps, cfg.decode_unroll


def plan(
    m: int,
    dim: int,
    kkind: int,
    kbits: int,
    kgroup: int,
    vkind: int,
    vbits: int,
    vgroup: int,
    sketch: bool = False,
    key_rows: int | None = None,
    key_block: int = 1,
    settings: KernelConfig | None = None,
) -> Plan | None:
    """The kernel's layout for ``m`` query rows of head dim ``dim``, or None if unsupported.

    Channels per lane (8, 16 or 32) must fill whole code words for both widths and divide the
    head dim into at most 32 lanes; affine groups must hold whole lanes or whole sub-blocks
    of one. Query rows and channels per lane share a register budget of :data:`MAX_REGS`
    (:data:`CUDA_WIDE_REGS` for 32 channels a lane on CUDA; half of :data:`MAX_REGS` with a
    key ``sketch``: the sketched query takes the other half); rows per
    threadgroup are a power of two (at most 8). A sketch needs codebook keys and a head dim
    that is a multiple of 32. Each side's layout (:mod:`velox_core.kernels.layout`) says
    which lanes read it (:func:`side_ok`) and whether its value pass mixes it.

    Keys scored by their layout's own pass may cap the query rows a pass holds
    (``key_rows``: :meth:`~velox_core.kernels.layout.Layout.key_rows`; below 1 declines) and
    need splits of whole blocks of ``key_block`` tokens
    (:meth:`~velox_core.kernels.layout.Layout.split_block`), which must fit one split.
    ``settings``: the configuration whose warps and unroll it takes (:func:`tuning`).
    """
    klay, vlay = layout_for(kkind), layout_for(vkind)
    if m < 1 or dim < 1 or klay is None or vlay is None or not vlay.mixes_values:
        return None
    if sketch and (kkind != CODEBOOK or dim % 32):
        return None
    if key_rows is not None and key_rows < 1:
        return None
    budget = MAX_REGS // 2 if sketch else MAX_REGS
    nwarps, unroll = tuning(settings)
    order = (32, 16, 8) if m <= 2 else (16, 32, 8) if m <= 4 else (8, 16, 32)
    for cpl in order:
        if dim % cpl or dim // cpl > 32:
            continue
        if not (
            side_ok(kkind, kbits, kgroup, dim, cpl) and side_ok(vkind, vbits, vgroup, dim, cpl)
        ):
            continue
        regs = budget
        if cpl == 32 and not sketch and klay.wide and vlay.wide:
            regs = CUDA_WIDE_REGS if _kernels.backend() == "cuda" else budget
        if regs < cpl:
            continue
        mb = min(regs // cpl, _pow2_ceil(m), 8)
        while mb > 1 and nwarps * mb * dim > MAX_MERGE_FLOATS:
            mb //= 2
        if nwarps * mb * dim > MAX_MERGE_FLOATS:
            continue
        mb = _pow2_floor(mb)
        lanes = _pow2_ceil(dim // cpl)
        step = nwarps * (32 // lanes) * unroll
        if key_rows is not None:
            mb = min(mb, _pow2_floor(key_rows))
        if key_block > SCORE_SLOTS // mb:  # a block must fit one split
            return None
        return Plan(cpl, mb, -(-m // mb), lanes, nwarps, unroll, step, SCORE_SLOTS // mb)
    return None


def plan_for(
    m: int,
    dim: int,
    keys: CodeRecord,
    values: CodeRecord,
    settings: KernelConfig | None = None,
) -> Plan | None:
    """:func:`plan` for the two sides of a segment (the keys' layout's row cap and blocks)."""
    klay = layout_of(keys)
    return plan(
        m,
        dim,
        keys.kind,
        keys.bits,
        keys.group,
        values.kind,
        values.bits,
        values.group,
        keys.signs is not None,
        klay.key_rows(keys, dim),
        klay.split_block(keys),
        settings,
    )


def choose_splits(tokens: int, rows: int, p: Plan, settings: KernelConfig | None = None) -> int:
    """Splits of a ``tokens``-long context for ``rows`` (batch x KV heads) sequences.

    Aims at ``KernelConfig.blocks`` threadgroups (default :data:`DEFAULT_BLOCKS`) with at least
    :data:`MIN_SPAN` tokens each, and never more than ``p.max_span`` tokens per split; every
    split is non-empty (the kernel takes ``ceil(T / splits)`` tokens per split). ``settings``:
    the configuration to read (default: the one in force).
    """
    target = (settings or kernel_config()).blocks or DEFAULT_BLOCKS
    want = max(1, math.ceil(target / max(1, rows * p.nmb)))
    s = max(1, min(want, math.ceil(tokens / max(MIN_SPAN, p.step))))
    return fit_splits(tokens, s, p)


def fit_splits(tokens: int, splits: int, p: Plan) -> int:
    """``splits`` adjusted so that no split is empty and none holds more than ``p.max_span``."""
    s = max(1, min(int(splits), tokens), math.ceil(tokens / p.max_span))
    return math.ceil(tokens / math.ceil(tokens / s))


def block_splits(tokens: int, splits: int, p: Plan, keys: CodeRecord) -> int:
    """``splits`` adjusted for keys whose layout needs splits of whole blocks
    (:meth:`~velox_core.kernels.layout.Layout.split_block`): the kernel rounds a split's
    ``ceil(T / splits)`` tokens up to whole blocks, so the count is raised until that span
    fits ``p.max_span``, then lowered to the splits the span needs (none empty). Unchanged
    for blocks of one token; :func:`plan` declines blocks longer than a split."""
    g = layout_of(keys).split_block(keys)
    if g <= 1:
        return splits
    if g > p.max_span:
        raise ValueError(f"block_splits: blocks of {g} tokens exceed a split's {p.max_span}")

    def span(s: int) -> int:  # the kernel's tokens per split
        return math.ceil(math.ceil(tokens / s) / g) * g

    s = splits
    while span(s) > p.max_span:
        s += 1
    return math.ceil(tokens / span(s))


def template(
    p: Plan, dim: int, k: CodeRecord, v: CodeRecord, scale: float | None = None
) -> list[tuple[str, int]]:
    """The body's compile-time constants for a plan (``scale``: the attention scale the kernel
    applies to unscaled queries; None when they come scaled). ``KOWN`` is 1 where the keys'
    layout brings its own key pass (:attr:`~velox_core.kernels.layout.Layout.key_pass`),
    ``KOLV`` the floats of its table the kernel copies to threadgroup memory; its own
    constants (:meth:`~velox_core.kernels.layout.Layout.constants`) come last."""
    klay, vlay = layout_of(k), layout_of(v)
    return [
        ("MB", p.mb),
        ("HD", dim),
        ("KBITS", k.bits),
        ("VBITS", v.bits),
        ("KKIND", k.kind),
        ("VKIND", v.kind),
        ("KGROUP", klay.group_constant(k, dim)),
        ("VGROUP", vlay.group_constant(v, dim)),
        ("CPL", p.cpl),
        ("NWARPS", p.nwarps),
        ("UNROLL", p.unroll),
        ("QMUL", qmul_bits(scale)),
        ("KRSK", int(k.signs is not None)),
        ("KOWN", int(klay.key_pass is not None)),
        ("KOLV", klay.table_floats(k, dim)),
        ("KFLY", int(klay.butterfly)),
        ("KSPAN", klay.split_block(k)),
        *klay.constants(k, dim),
    ]


def plan_portable(
    q_shape: tuple[int, int, int, int],
    keys: CodeRecord,
    values: CodeRecord,
    splits: int | None,
    scale: float | None,
    settings: KernelConfig | None = None,
):
    """The portable kernel's launch for a fixed query shape, as ``run(q, q_sketch)``
    returning the per-split partials (query rows padded to its row blocks) and the padded
    query it took, or None where it has no layout for the shape (``settings``: as
    :func:`plan`)."""
    b, h, m, dim = q_shape
    t = keys.codes.shape[2]
    p = plan_for(m, dim, keys, values, settings)
    if p is None:
        return None
    check_codes("key", keys, b, h, t, dim)
    check_codes("value", values, b, h, t, dim)
    mp = p.nmb * p.mb
    s = choose_splits(t, b * h, p, settings) if splits is None else fit_splits(t, splits, p)
    s = block_splits(t, s, p, keys)
    nt = p.nwarps * 32
    kernel, tmpl = decode_spec(keys).kernel(), template(p, dim, keys, values, scale)
    codes = [*code_inputs(keys), *code_inputs(values)]
    grid, tg = (s * nt, b * h, p.nmb), (nt, 1, 1)
    shapes = [(b, h, s, mp, dim), (b, h, s, mp, 2)]
    plain = layout_of(keys).query_shape(keys, b, h, m, dim) is None
    extra = sketch_inputs(keys, None, mp) if plain else None

    def run(q, q_sketch=None):
        qf = q if scale is not None else q.astype(mx.float32)  # unscaled: the kernel scales it
        if mp > m:  # zero query rows up to the row blocks (layout.pad_rows, in place here)
            qf = mx.concatenate([qf, mx.zeros((b, h, mp - m, dim), qf.dtype)], axis=2)
        more = extra if plain else sketch_inputs(keys, q_sketch, mp)
        o_part, ml_part = kernel(
            inputs=[qf, *codes, *more],
            template=tmpl,
            grid=grid,
            threadgroup=tg,
            output_shapes=shapes,
            output_dtypes=[mx.float32, mx.float32],
        )
        return o_part, ml_part, qf

    return run
