"""Decode attention over rotated codebook codes whose channels split per group of tokens into
an outlier part and the rest (``metal/decode_attention_outlier.metal``, shipped by this
package and built with velox-core's kernel machinery).

TurboQuant's fractional widths (3.5 bits: 64 channels at 4 bits and 64 at 3 bits at head dim
128) choose the outlier channels per group of tokens, keep a mask per group, and code each
part in its own randomized-Hadamard-rotated domain with its own norm and Lloyd-Max levels.
The rotated query therefore differs from group to group, and so does the map that brings the
values back: the kernel places the query in each group's key parts, runs the Hadamard
butterflies (registers and warp shuffles), scores the group's tokens from both parts' codes, mixes
the values in their parts' rotated domain and brings that sum back (butterflies, signs,
the mask's channel order) into a running output in the model's domain, with an online
softmax along the split. One pass over the codes; the partials go to the same merge kernels
as the other decode kernels'.

A side of one part (an integer width beside a fractional one, e.g. 3.5-bit keys with 4-bit
values) takes the same kernel without a mask.

Its one setting, the threadgroup size (``VELOX_OUTLIER_THREADS``: 64 or 128), is
:class:`OutlierConfig`, read from the environment once (``OutlierConfig.current()``) and
replaced for a block by ``OutlierConfig.configured(threads=...)``.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import ClassVar

import mlx.core as mx
import numpy as np

from velox_core.kernels.build import KernelSpec
from velox_core.kernels.config import PackageSettings, register_settings
from velox_core.kernels.layout import FP16_MAX, pad_rows, qmul_bits, unused_input
from velox_core.kernels.merge import merge_splits, plan_merge_fp16

__all__ = [
    "OUTLIER",
    "OutlierConfig",
    "OutlierSide",
    "RotatedPart",
    "decode_attention_outlier",
    "outlier_launch",
    "outlier_parts",
    "outlier_spec",
    "outlier_template",
    "outlier_threads",
    "side_table",
]

OUTLIER = KernelSpec(
    name="velox_decode_attention_outlier",
    source="decode_attention_outlier.metal",
    package="velox_turboquant",
    inputs=(
        *("q", "khc", "khn", "klc", "kln", "kmk", "kax"),
        *("vhc", "vhn", "vlc", "vln", "vmk", "vax"),
    ),
    outputs=("o_part", "ml_part"),
    row_contiguous=False,  # the body reads strides: slices of a cache buffer are not copied
    # (launched through outlier_spec, which adds CUDA launch bounds for the threadgroup size:
    # at most 128 registers a thread, 512 threads an SM; on an H200 the first version took
    # 150 registers unbounded and ran 27% faster bounded)
)
THREADS = 64  # threads per threadgroup by default (the body's NT; 128 measured 3-6% slower)
THREAD_CHOICES = (64, 128)  # what OutlierConfig.threads may ask for
SM_THREADS = 512  # threads an SM under the launch bounds (128 registers each)
SMEM_BYTES = 32 * 1024  # Metal's threadgroup memory (the body's arrays must fit)
MAX_ROWS = 8  # query rows per threadgroup
MAX_OUT = 1024  # rows x head dim per threadgroup (16 running outputs a thread at 64 threads)
QUERY_REGS = 32  # query values a scoring lane holds (rows x channels / lanes per token)
MIN_SPAN = 256  # fewest tokens per split (unless the context is shorter)
DEFAULT_THREADS = 1024 * 128  # threads to aim for over the grid
_SPECS: dict = {}  # (OUTLIER, threads) -> its spec


@register_settings
@dataclass(frozen=True)
class OutlierConfig(PackageSettings):
    """The outlier kernel's setting, read from the environment once
    (:meth:`~velox_core.kernels.config.PackageSettings.current`).

    Attributes:
        threads: threads per threadgroup (64 or 128; None: :data:`THREADS`), from
            ``VELOX_OUTLIER_THREADS``.
    """

    ENVIRONMENT: ClassVar[dict[str, tuple[str, str]]] = {
        "threads": ("VELOX_OUTLIER_THREADS", "int")
    }
    threads: int | None = None

    def __post_init__(self) -> None:
        if self.threads is not None and self.threads not in THREAD_CHOICES:
            alts = ", ".join(str(t) for t in THREAD_CHOICES)
            raise ValueError(f"OutlierConfig.threads must be one of {alts}, got {self.threads!r}")


def outlier_threads() -> int:
    """Threads per threadgroup: :data:`THREADS`, or ``OutlierConfig.threads`` (64 or 128).
    (One warp a threadgroup needs about 250 registers a thread: its share of a group's
    records loaded ahead, its entries of the butterflies, its query values; under a
    128-register bound it spills, with 255 it ran 1.5x slower on an H200.)"""
    return OutlierConfig.current().threads or THREADS


def outlier_spec(nt: int) -> KernelSpec:
    """The kernel's spec for threadgroups of ``nt`` threads: :data:`OUTLIER` with launch
    bounds for :data:`SM_THREADS` threads an SM (its own name: its own build)."""
    if nt not in THREAD_CHOICES:
        raise ValueError(f"outlier_spec: threads must be one of {THREAD_CHOICES}, got {nt}")
    key = (OUTLIER, nt)  # (OUTLIER itself: a profiling script may swap in a variant)
    spec = _SPECS.get(key)
    if spec is None:
        spec = _SPECS[key] = dataclasses.replace(
            OUTLIER, name=f"{OUTLIER.name}_t{nt}", cuda_launch_bounds=(nt, SM_THREADS // nt)
        )
    return spec


# (rows, head dim, threads, scale, keys' and values' shape keys) -> (launch, template): a
# decode step asks for the same layout in every layer
_LAYOUTS: dict = {}
_LAYOUTS_MAX = 256


def _shape_key(s: OutlierSide) -> tuple:
    """What :func:`outlier_launch` and :func:`outlier_template` read of a side."""
    parts = tuple((p.bits, p.channels, p.block) for p in s.parts)
    return (s.group if s.mask is not None else None, parts)


def _layout(m: int, dim: int, keys: OutlierSide, values: OutlierSide, scale: float | None):
    """``(launch, template)`` for the shape (None, None where the kernel has none), worked
    out once per shape and threadgroup size."""
    nt = outlier_threads()
    key = (m, dim, nt, scale, _shape_key(keys), _shape_key(values))
    hit = _LAYOUTS.get(key)
    if hit is None:
        launch = outlier_launch(m, dim, keys, values, nt)
        tmpl = None if launch is None else outlier_template(launch, dim, keys, values, scale)
        if len(_LAYOUTS) >= _LAYOUTS_MAX:
            _LAYOUTS.clear()
        hit = _LAYOUTS[key] = (launch, tmpl)
    return hit


@dataclass(frozen=True)
class RotatedPart:
    """The static side of one part: its width, channels, levels and rotation.

    Attributes:
        bits: code width (1 to 8).
        channels: channels of the part.
        levels: ``(2**bits,)`` codebook levels (float32 host values or an array).
        signs: ``(channels,)`` the rotation's sign flips.
        inv_perm: ``(channels,)`` the inverse of the rotation's channel permutation (None:
            none), so that channel ``j`` lands in slot ``inv_perm[j]`` of the Hadamard input.
        block: the orthonormal Hadamard blocks' size (a power of two dividing ``channels``).
    """

    bits: int
    channels: int
    levels: object
    signs: object
    inv_perm: object | None
    block: int


def side_table(parts: tuple[RotatedPart, ...]) -> mx.array:
    """A side's static table (``kax`` / ``vax``): per part its signs over ``sqrt(block)`` and
    its slots, then the parts' levels, float32 (see the kernel's header). ``parts``: the
    outlier part and the rest, or the one part of an integer width."""
    signs, slots, levels = [], [], []
    for p in parts:
        if p.block < 2 or p.block & (p.block - 1) or p.channels % p.block:
            raise ValueError(
                f"side_table: Hadamard block {p.block} must be a power of two dividing "
                f"{p.channels} channels"
            )
        s = np.asarray(p.signs, dtype=np.float32).reshape(-1)
        slot = (
            np.arange(p.channels)
            if p.inv_perm is None
            else np.asarray(p.inv_perm, dtype=np.int64).reshape(-1)
        )
        lev = np.asarray(p.levels, dtype=np.float32).reshape(-1)
        if s.size != p.channels or slot.size != p.channels or lev.size != 1 << p.bits:
            raise ValueError(
                f"side_table: a part of {p.channels} channels at {p.bits} bits needs as many "
                f"signs and slots and {1 << p.bits} levels, got {s.size}, {slot.size}, "
                f"{lev.size}"
            )
        signs.append(s / math.sqrt(p.block))
        slots.append(slot.astype(np.float32))
        levels.append(lev)
    table = [x for pair in zip(signs, slots) for x in pair] + levels
    return mx.array(np.concatenate(table).astype(np.float32))


@dataclass
class OutlierSide:
    """One side (keys or values) of a segment, as the kernel reads it.

    Attributes:
        parts: the static parts: ``(outliers, rest)``, or ``(whole,)`` for a side of one part.
        codes: per part ``(B, H, T, W)`` uint32 packed codes, in the order of ``parts``.
        norms: per part ``(B, H, T)`` norms (fp16, bf16 or float32).
        mask: two parts: ``(B, H, T / group, ceil(D / 32))`` uint32, bit ``c`` set where
            channel ``c`` is an outlier (as many set bits as the outlier part's channels);
            None for one part.
        group: tokens per mask (two parts).
        table: :func:`side_table` of ``parts`` (kept by the caller: static per codec).
    """

    parts: tuple[RotatedPart, ...]
    codes: tuple[mx.array, ...]
    norms: tuple[mx.array, ...]
    mask: mx.array | None
    group: int
    table: mx.array


def _check_side(name: str, s: OutlierSide, b: int, h: int, t: int, dim: int) -> None:
    n = len(s.parts)
    if n not in (1, 2) or len(s.codes) != n or len(s.norms) != n:
        raise ValueError(f"{name}: one or two parts, with codes and norms for each")
    if sum(p.channels for p in s.parts) != dim:
        raise ValueError(
            f"{name}: the parts' channels {[p.channels for p in s.parts]} must add up to the "
            f"head dim {dim}"
        )
    if (n == 2) != (s.mask is not None):
        raise ValueError(f"{name}: a mask goes with two parts, and only with two")
    for p, c, nm in zip(s.parts, s.codes, s.norms):
        words = (p.channels * p.bits + 31) // 32
        if c.dtype != mx.uint32 or tuple(c.shape) != (b, h, t, words):
            raise ValueError(
                f"{name}: codes of a {p.channels}-channel {p.bits}-bit part must be uint32 "
                f"{(b, h, t, words)}, got {c.dtype} {tuple(c.shape)}"
            )
        if tuple(nm.shape) != (b, h, t):
            raise ValueError(f"{name}: norms must be {(b, h, t)}, got {tuple(nm.shape)}")
    if s.mask is not None:
        want = (b, h, t // s.group, (dim + 31) // 32)
        if s.mask.dtype != mx.uint32 or tuple(s.mask.shape) != want:
            raise ValueError(
                f"{name}: the mask must be uint32 {want}, got {s.mask.dtype} {tuple(s.mask.shape)}"
            )


def _words(p: RotatedPart) -> int:
    return (p.channels * p.bits + 31) // 32


def _score_lanes(mb: int, dim: int, keys: OutlierSide) -> int | None:
    """Lanes per scored token: each takes a contiguous chunk of every key part's channels,
    at most 32 bits of codes (read as one word at a shift), and the chunks' query values of
    ``mb`` rows fit :data:`QUERY_REGS` registers; None where no power of two up to 32 does.
    (64 values at 8 lanes a token, 4 rows and 128 threads, fit 128 registers too, with fewer
    instructions a token, but measured 6% slower on an H200 than 16 lanes.)"""
    for lanes in (4, 8, 16, 32):
        if mb * dim > QUERY_REGS * lanes:
            continue
        if all(p.channels % lanes == 0 and p.channels // lanes * p.bits <= 32 for p in keys.parts):
            return lanes
    return None


def _value_chunks(
    mb: int, values: OutlierSide, nt: int = THREADS
) -> tuple[tuple[int, ...], int] | None:
    """Channels per chunk of each value part (a power of two dividing the part, at most 32
    bits of codes and 32 accumulators of ``mb`` rows) and the token sets sharing a chunk (a
    power of two: chunks x sets at most ``nt`` threads); None where the chunks outnumber the
    threads."""
    sizes = []
    for p in values.parts:
        c = p.channels & -p.channels
        while c > 1 and (c * p.bits > 32 or c * mb > 32):
            c //= 2
        sizes.append(c)
    chunks = sum(p.channels // c for p, c in zip(values.parts, sizes))
    if chunks > nt:
        return None
    sets = 1
    while sets < 32 and chunks * sets * 2 <= nt:
        sets *= 2
    return tuple(sizes), sets


def outlier_launch(
    m: int, dim: int, keys: OutlierSide, values: OutlierSide, threads: int | None = None
):
    """``(rows per threadgroup, lanes per scored token, group, threads)`` for the shape, or
    None where the kernel has no layout for it (more than :data:`MAX_OUT` outputs per row
    block, a group that does not fit threadgroup memory, sides with different groups).
    ``threads``: per threadgroup (default :func:`outlier_threads`)."""
    nt = outlier_threads() if threads is None else threads
    if nt not in THREAD_CHOICES:
        raise ValueError(f"outlier_launch: threads must be one of {THREAD_CHOICES}, got {nt}")
    groups = {s.group for s in (keys, values) if s.mask is not None}
    if len(groups) != 1:
        return None  # no fractional side (the other kernels take it), or two groups
    group = groups.pop()
    mb = 1
    while mb < min(m, MAX_ROWS) or mb * dim < nt:
        mb *= 2  # (the butterflies take whole entries per thread: padded rows below that)
    while mb > 1 and mb * dim > MAX_OUT:
        mb //= 2
    if mb * dim > MAX_OUT or (mb * dim) % nt:
        return None
    for side in (keys, values):
        # the butterflies pair entries by index: each part starts at a multiple of its
        # blocks, and a thread's entries lie in one part
        ept = mb * dim // nt
        start = 0
        for p in side.parts:
            if start % p.block or dim % p.block or start % ept:
                return None
            start += p.channels
    lanes = _score_lanes(mb, dim, keys)
    if lanes is None:
        return None
    cw = max(sum(_words(p) for p in keys.parts), sum(_words(p) for p in values.parts))
    table = sum(2 * p.channels + (1 << p.bits) for p in keys.parts + values.parts)
    if _value_chunks(mb, values, nt) is None:
        return None
    floats = table + 2 * mb * dim + group * cw + 1 + 2 * group + group * mb + 2 * ((dim + 31) // 32)
    if 4 * (floats + 3 * mb) > SMEM_BYTES:
        return None
    return mb, lanes, group, nt


def outlier_template(
    launch: tuple[int, int, int, int],
    dim: int,
    keys: OutlierSide,
    values: OutlierSide,
    scale: float | None,
) -> list[tuple[str, int]]:
    """The kernel's template constants for a launch of :func:`outlier_launch`."""
    mb, lanes, group, nt = launch
    out = [("HD", dim), ("MB", mb), ("LPT", lanes), ("GROUP", group), ("NT", nt)]
    out.append(("QMUL", qmul_bits(scale)))
    sizes, sets = _value_chunks(mb, values, nt)
    out += [("VCHH", sizes[0] if len(sizes) == 2 else 1), ("VCL", sizes[-1]), ("VTS", sets)]
    for pre, s in (("K", keys), ("V", values)):
        hi, lo = (s.parts[0], s.parts[1]) if len(s.parts) == 2 else (None, s.parts[0])
        out += [
            (pre + "NH", 0 if hi is None else hi.channels),
            (pre + "BH", 1 if hi is None else hi.bits),
            (pre + "BL", lo.bits),
            (pre + "BKH", 1 if hi is None else hi.block),
            (pre + "BKL", lo.block),
        ]
    return out


def _inputs(s: OutlierSide) -> list[mx.array]:
    """One side's six inputs; a side of one part has no hi part and no mask (the decode
    kernels' unused-input dummies stand in, never read)."""
    if len(s.parts) == 2:
        return [s.codes[0], s.norms[0], s.codes[1], s.norms[1], s.mask, s.table]
    du, df = unused_input(mx.uint32), unused_input(mx.float16)
    return [du, df, s.codes[0], s.norms[0], du, s.table]


def outlier_parts(
    q_shape: tuple[int, int, int, int],
    keys: OutlierSide,
    values: OutlierSide,
    splits: int | None = None,
    scale: float | None = None,
):
    """The outlier kernel planned for one segment and a query shape, as
    ``parts(q) -> (o_part, ml_part, q padded)`` (the split partials velox-core's merge kernels
    join), or None where it has no layout for the shape (see :func:`outlier_launch`).

    Args: as :func:`decode_attention_outlier`.
    """
    b, h, m, dim = q_shape
    t = keys.codes[-1].shape[2]
    launch, tmpl = _layout(m, dim, keys, values, scale)
    if t < 1 or launch is None:
        return None
    mb, _, group, nt = launch
    if t % group:
        raise ValueError(
            f"decode_attention_outlier: {t} tokens are not whole groups of {group} (the "
            "masks cover groups of tokens)"
        )
    _check_side("keys", keys, b, h, t, dim)
    _check_side("values", values, b, h, t, dim)
    nmb = (m + mb - 1) // mb
    mp = nmb * mb
    groups = t // group
    if splits is None:
        want = max(1, math.ceil(DEFAULT_THREADS / nt / max(1, b * h * nmb)))
        splits = min(want, math.ceil(groups / max(1, math.ceil(MIN_SPAN / group))))
    s = max(1, min(int(splits), groups))
    s = math.ceil(groups / math.ceil(groups / s))  # no empty split
    sides = [*_inputs(keys), *_inputs(values)]

    def parts(q: mx.array, q_side=None):
        qf = q if scale is not None else q.astype(mx.float32)
        qf = pad_rows(qf, mp)
        o_part, ml_part = outlier_spec(nt).kernel()(
            inputs=[qf, *sides],
            template=tmpl,
            grid=(s * nt, b * h, nmb),
            threadgroup=(nt, 1, 1),
            output_shapes=[(b, h, s, mp, dim), (b, h, s, mp, 2)],
            output_dtypes=[mx.float32, mx.float32],
        )
        return o_part, ml_part, qf

    return parts


def decode_attention_outlier(
    q: mx.array,
    keys: OutlierSide,
    values: OutlierSide,
    splits: int | None = None,
    fp16: list[tuple[mx.array, mx.array]] | None = None,
    out_dtype: mx.Dtype | None = None,
    scale: float | None = None,
) -> tuple[mx.array, mx.array, mx.array] | None:
    """Partial attention ``(o, m, l)`` of ``q`` over one segment, or None where the kernel has
    no layout for the shape (see :func:`outlier_launch`).

    Args:
        q: ``(B, H, M, D)`` grouped queries in the model's domain: float32 with the scale
            applied, or (with ``scale``) unscaled in any float dtype.
        keys, values: the segment's sides; at least one with two parts (a mask).
        splits: number of context chunks (whole groups each; default: about
            :data:`DEFAULT_THREADS` threads in threadgroups of at least :data:`MIN_SPAN`
            tokens).
        fp16, out_dtype: up to two fp16 segments joined in the same softmax by the merge
            (:func:`velox_core.kernels.merge.plan_merge_fp16`); ``o`` is then the
            normalized attention over all of them, in ``out_dtype``.
        scale: the attention scale, when ``q`` comes without it.

    Shapes:
        returns ``o (B, H, M, D)``, ``m (B, H, M, 1)``, ``l (B, H, M, 1)``, float32 (``o`` in
        ``out_dtype`` and normalized when ``out_dtype`` is given).
    """
    if (fp16 is not None) != (out_dtype is not None):
        raise ValueError("decode_attention_outlier: fp16 segments and out_dtype go together")
    if fp16 is not None and (len(fp16) > 2 or sum(k.shape[2] for k, _ in fp16) > FP16_MAX):
        return None
    m = q.shape[2]
    parts = outlier_parts(q.shape, keys, values, splits, scale)
    if parts is None:
        return None
    o_part, ml_part, qf = parts(q)
    if out_dtype is not None:
        b, h, _, rows, dim = o_part.shape
        merge = plan_merge_fp16(b, h, rows, dim, out_dtype, scale, None)
        o, mm, ll = merge(o_part, ml_part, qf, fp16 or [])
    else:
        o, mm, ll = merge_splits(o_part, ml_part)
    if qf.shape[2] > m:
        o, mm, ll = o[:, :, :m], mm[:, :, :m], ll[:, :, :m]
    return o, mm, ll
