"""The block layout of ZipCache's codecs (:class:`MixedBlocks`): in each block of ``group``
tokens and each KV head, the salient tokens' codes at ``bits`` and the others' at
``low_bits``, two dense arrays because every block holds exactly ``salient_count(group,
salient)`` salient tokens; which is which, one bit per token. :mod:`velox_zipcache.codec`
gives the two quantization schemes on this layout.

Attention reads the codes (``scores``, ``mix``): each precision group's scales are folded
into the query or the weights, so ``mx.quantized_matmul`` multiplies by the packed codes
themselves (a token's channels are one MLX group: head dims that are multiples of 32, widths
2-6 and 8), and the block's scores are put back in temporal order from the mask (a gather of
one score per token). Other shapes unpack the codes first.
"""

from __future__ import annotations

import mlx.core as mx

from velox_core import Codec, Packed
from velox_core.ops import mlx_readable, pack, scale_dtype, unpack
from velox_core.ops.packing import MLX_GROUPS
from velox_core.validation import check_array, check_bits, check_float, check_int

__all__ = ["MixedBlocks", "affine", "codes_matmul", "locality", "salient_count"]


def salient_count(group: int, salient: float) -> int:
    """Salient tokens per block: ``group`` minus the regular ones, ``int((1 - salient) *
    group)`` (the reference code's count, ``int(ratio * n)`` regular tokens), with a small
    epsilon so that ``0.4 * 100`` is 40 and not 39 under rounding."""
    return group - max(0, min(group, int((1.0 - salient) * group + 1e-6)))


def locality(b: int, h: int, t: int, group: int, count: int) -> mx.array:
    """The newest ``count`` tokens of each block salient (the paper's "locality" rule): the
    saliency of tokens no query has scored.

    Shapes: returns bool ``(B, H, T)``.
    """
    pos = mx.arange(t) % group
    return mx.broadcast_to(pos >= group - count, (b, h, t))


def affine(x: mx.array, bits: int, axis: int, sdt: mx.Dtype):
    """Asymmetric ``bits``-bit codes of ``x`` with one scale and minimum along ``axis``.

    Shapes: x float32; returns uint8 codes like ``x`` and scale, minimum with ``axis`` kept
    (size 1), in ``sdt``.
    """
    lo = mx.min(x, axis=axis, keepdims=True)
    hi = mx.max(x, axis=axis, keepdims=True)
    levels = (1 << bits) - 1
    scale = ((hi - lo) / levels).astype(sdt)
    zero = lo.astype(sdt)
    # against the stored scale and minimum (a group whose scale rounds to 0 decodes to its
    # minimum whatever its codes)
    s = mx.maximum(scale.astype(mx.float32), 1e-30)
    q = mx.round((x - zero.astype(mx.float32)) / s)
    return mx.clip(q, 0, levels).astype(mx.uint8), scale, zero


def _mlx_group(d: int) -> int | None:
    """The MLX group that splits ``d`` channels evenly (the largest), or None."""
    return next((g for g in sorted(MLX_GROUPS, reverse=True) if d % g == 0), None)


def codes_matmul(
    x: mx.array,
    words: mx.array,
    bits: int,
    d: int,
    transpose: bool,
    scale: mx.array | None = None,
    zero: mx.array | None = None,
) -> mx.array:
    """``x @ w.T`` (``transpose``) or ``x @ w``, ``w`` the tokens' codes (``scale * code +
    zero`` per token where given, else the integer codes), by ``mx.quantized_matmul`` on the
    packed words where MLX reads them, else through unpacked codes.

    Shapes: x ``(..., M, d)`` (``transpose``) or ``(..., M, n)``; words uint32 ``(..., n, W)``;
    scale and zero ``(..., n)``; returns ``(..., M, n)`` or ``(..., M, d)``.
    """
    group = _mlx_group(d)
    if group is not None and mlx_readable(bits, group):
        shape = (*words.shape[:-1], d // group)
        if scale is None:
            s, z = mx.ones(shape, dtype=mx.float16), mx.zeros(shape, dtype=mx.float16)
        else:
            s, z = (mx.broadcast_to(a[..., None], shape) for a in (scale, zero))
        return mx.quantized_matmul(x, words, s, z, transpose=transpose, group_size=group, bits=bits)
    c = unpack(words, bits, d).astype(mx.float32)
    if scale is not None:
        c = c * scale.astype(mx.float32)[..., None] + zero.astype(mx.float32)[..., None]
    return x @ (mx.swapaxes(c, -1, -2) if transpose else c)


class MixedBlocks(Codec):
    """The layout both schemes share (see the module): a subclass gives :meth:`_code`,
    :meth:`_values`, :meth:`_part_scores` and :meth:`_part_mix`.

    Args:
        bits: width of the salient tokens' codes, 2 to 8 (the paper: 4).
        low_bits: width of the other tokens' codes, 1 to ``bits`` (the paper: 2).
        salient: fraction of each block's tokens that are salient, in ``[0, 1]``.
        group: tokens per block (the paper's streaming interval, 100).
    """

    settings = ("bits", "low_bits", "salient", "group")
    compressed_scores = True
    compressed_mix = True

    def __init__(self, bits: int = 4, low_bits: int = 2, salient: float = 0.6, group: int = 100):
        self.bits = check_bits("bits", bits, minimum=2, maximum=8)
        self.low_bits = check_bits("low_bits", low_bits, minimum=1, maximum=self.bits)
        self.salient = check_float("salient", salient, minimum=0.0, maximum=1.0)
        self.group = check_int("group", group, minimum=1)
        self.block = self.group
        self.count = salient_count(self.group, self.salient)

    # -- coding ------------------------------------------------------------------------------
    def encode(self, x: mx.array, positions: mx.array | None = None) -> Packed:
        """Without a saliency (the codec alone): each block's newest tokens are salient
        (:func:`locality`); the cache codes through :meth:`encode_mixed`."""
        b, h, t, _ = x.shape
        return self.encode_mixed(x, locality(b, h, t, self.group, self.count))

    def encode_mixed(self, x: mx.array, salient: mx.array) -> Packed:
        """Code ``x`` with the given salient tokens, exactly ``self.count`` per block and head.

        Shapes: x ``(B, H, T, D)`` with ``T % group == 0``; salient bool ``(B, H, T)``.
        """
        check_array("salient", salient, ndim=3)
        b, h, t, d = x.shape
        g, s = self.group, self.count
        pages = x.astype(mx.float32).reshape(b, h, t // g, g, d)
        data: dict[str, mx.array] = {}
        if 0 < s < g:
            sal = salient.reshape(b, h, t // g, g)
            # the block's tokens reordered: the salient ones first, then the others, each in
            # ascending position (the order decode restores from the mask)
            order = mx.argsort(mx.where(sal, 0, g) + mx.arange(g), axis=-1)
            pages = mx.take_along_axis(pages, order[..., None], axis=3)
            data["mask"] = pack(sal.astype(mx.uint8), 1)
        data.update(self._code(pages, scale_dtype(x.dtype)))
        return Packed(data, t, g, frozenset(data))

    def _code(self, pages: mx.array, sdt: mx.Dtype) -> dict[str, mx.array]:
        """The codes and parameters of blocks whose salient tokens come first.

        Shapes: pages float32 ``(B, H, P, g, D)``.
        """
        raise NotImplementedError

    def _values(self, p: dict[str, mx.array], part: str, bits: int, n: int) -> mx.array:
        """One precision group's decoded tokens (before :meth:`_finish`).

        Shapes: returns float32 ``(B, H, P, n, D)``.
        """
        raise NotImplementedError

    def _finish(self, x: mx.array, p: dict[str, mx.array]) -> mx.array:
        """What applies to a whole decoded block (in temporal order)."""
        return x

    def _split(self, pages: mx.array) -> list[tuple[str, int, mx.array]]:
        """``(name, bits, tokens)`` of the salient and the regular group of blocks whose
        salient tokens come first (:meth:`_parts`)."""
        out, start = [], 0
        for name, bits, n in self._parts():
            out.append((name, bits, pages[:, :, :, start : start + n]))
            start += n
        return out

    def _coded_groups(self, pages: mx.array, axis: int, sdt: mx.Dtype) -> dict[str, mx.array]:
        """Each group of :meth:`_split` coded at its width: its packed codes (by the group's
        name) and its ``_scale`` and ``_zero``, taken over ``axis`` (3: per channel over the
        group's tokens; 4: per token over its channels) and stored in ``sdt``."""
        out = {}
        for name, bits, x in self._split(pages):
            codes, scale, zero = affine(x, bits, axis, sdt)
            out[name] = pack(codes, bits)
            out[f"{name}_scale"], out[f"{name}_zero"] = scale.squeeze(axis), zero.squeeze(axis)
        return out

    def salient_mask(self, packed: Packed) -> mx.array:
        """Which tokens of a record are salient.

        Shapes: returns bool ``(B, H, T)``.
        """
        p = packed.data
        b, h = next(iter(p.values())).shape[:2]
        if "mask" in p:
            m = unpack(p["mask"], 1, self.group).astype(mx.bool_)
            return m.reshape(b, h, packed.tokens)
        return mx.full((b, h, packed.tokens), self.count == self.group, dtype=mx.bool_)

    def _parts(self) -> list[tuple[str, int, int]]:
        """``(name, bits, tokens per block)`` of the salient and the regular group (an empty
        one left out), in the order their tokens are stored."""
        g, s = self.group, self.count
        parts = [("hi", self.bits, s), ("lo", self.low_bits, g - s)]
        return [part for part in parts if part[2]]

    def _rows(self, p: dict[str, mx.array]) -> mx.array | None:
        """Each token's row among its block's ``[salient | regular]`` codes (its rank within
        its group), or None where the block has one group.

        Shapes: returns int32 ``(B, H, P, g)``.
        """
        if "mask" not in p:
            return None
        sal = unpack(p["mask"], 1, self.group).astype(mx.int32)
        hi, lo = mx.cumsum(sal, axis=-1) - 1, self.count + mx.cumsum(1 - sal, axis=-1) - 1
        return mx.where(sal > 0, hi, lo)

    def scores(self, q: mx.array, packed: Packed) -> mx.array:
        p = packed.data
        b, h, m, _ = q.shape
        qb = q[:, :, None]  # (B, H, 1, M, D): one query block against every token block
        parts = [self._part_scores(qb, p, name, bits) for name, bits, _ in self._parts()]
        x = parts[0] if len(parts) == 1 else mx.concatenate(parts, axis=-1)  # (B, H, P, M, g)
        rows = self._rows(p)
        if rows is not None:  # back in temporal order: one score per token gathered
            x = mx.take_along_axis(x, mx.broadcast_to(rows[:, :, :, None], x.shape), axis=-1)
        return mx.swapaxes(x, 2, 3).reshape(b, h, m, packed.tokens)

    def mix(self, w: mx.array, packed: Packed) -> mx.array:
        p = packed.data
        b, h, m, t = w.shape
        g = self.group
        wb = mx.swapaxes(w.reshape(b, h, m, t // g, g), 2, 3)  # (B, H, P, M, g)
        rows = self._rows(p)
        if rows is not None:  # each token's weight moved to its code's row
            idx = mx.broadcast_to(rows[:, :, :, None], wb.shape)
            wb = mx.put_along_axis(mx.zeros_like(wb), idx, wb, axis=-1)
        out, start = None, 0
        for name, bits, n in self._parts():
            part = self._part_mix(wb[..., start : start + n], p, name, bits)
            out, start = part if out is None else out + part, start + n
        return mx.sum(self._finish_mix(out, p), axis=2)

    def _part_scores(self, q: mx.array, p: dict[str, mx.array], name: str, bits: int):
        """One precision group's ``q . x`` per block.

        Shapes: q float32 ``(B, H, 1, M, D)``; returns ``(B, H, P, M, n)``.
        """
        raise NotImplementedError

    def _part_mix(self, w: mx.array, p: dict[str, mx.array], name: str, bits: int):
        """One precision group's ``w @ x`` per block (before :meth:`_finish_mix`).

        Shapes: w float32 ``(B, H, P, M, n)``; returns ``(B, H, P, M, D)``.
        """
        raise NotImplementedError

    def _finish_mix(self, out: mx.array, p: dict[str, mx.array]) -> mx.array:
        """What applies to a block's mixed values ``(B, H, P, M, D)`` as a whole."""
        return out

    def decode(self, packed: Packed) -> mx.array:
        p = packed.data
        g = self.group
        parts = [self._values(p, name, bits, n) for name, bits, n in self._parts()]
        x = parts[0] if len(parts) == 1 else mx.concatenate(parts, axis=3)
        rows = self._rows(p)
        if rows is not None:  # back in temporal order
            x = mx.take_along_axis(x, rows[..., None], axis=3)
        x = self._finish(x, p)
        b, h, pg, _, d = x.shape
        return x.reshape(b, h, pg * g, d)
