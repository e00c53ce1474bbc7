"""Attention over a cache's segments with one joint softmax.

Each segment is a pair of (codec, packed) for keys and values, in temporal order. For a few
query tokens (decode), each key codec scores the grouped queries in its compressed domain,
the scores of all segments are concatenated, masked and normalized together, and each value
codec mixes its share of the weights (``p @ v``) from its codes. For many query tokens
(prefill chunks), segments are decoded once into the model's dtype and fused SDPA runs over
them, or (on the CPU, over long contexts) they are decoded a slice at a time under one online
softmax (below); all are ``softmax(q k^T * scale + mask) v`` over the same stored tokens.

On a GPU with kernels enabled, decode steps go through the fused decode kernels wherever a
segment's codecs give them their records (:func:`kernel_sides`, the one place that decides:
scores, running max, exponentials and the value mix in one pass over the codes, split along
the context); every segment returns a partial ``(o, max, sum)`` and :func:`merge_partials`
joins them with the log-sum-exp rule, which is the same single softmax.

Prefill over slices (:func:`tiled_prefill_attention`): a prefill chunk of ``L`` queries over
``T`` stored tokens through fused SDPA (:func:`prefill_attention`) decodes every stored token
of the layer in the model's dtype, and on the CPU, where MLX's fused SDPA is a plain
composition, it materializes the ``(Hq, L, T)`` score matrix and its softmax as well: a
transient that grows with the context. Sliced, the stored tokens are decoded ``tile`` at a
time (block-aligned slices of each segment's records); each slice's scores update a running
row maximum, a running sum and an unnormalized output in float32 (the log-sum-exp rule of
:func:`merge_partials`), so the transient is one slice's scores, ``(Hq, L, tile)``, whatever
the context. Each slice's update is evaluated (``mx.eval``) before the next slice's graph is
built: MLX would otherwise evaluate the running maxima of every slice first and hold all their
scores at once (and with ``mx.async_eval`` two slices' buffers may overlap: on the tiny
Qwen2-VL of velox-vlm's benchmark its run peaked at 41 or 47 MiB, against 31 with ``eval``).
Only segments whose codecs decode slices exactly
(:attr:`Codec.decodes_slices`) are sliced. On a GPU the fused SDPA kernel streams over the
keys without materializing the scores, so the automatic choice (:func:`prefill_tile`) slices
on the CPU only. The result is the fused path's softmax over the same stored tokens, computed
in float32 (the fused path computes in the model's dtype).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from math import lcm

import mlx.core as mx

from ..codec.base import Codec, Packed
from ..codec.identity import Identity
from ..kernels import use_kernels
from ..kernels.decode import plan_segment, segment_partial
from ..kernels.joint import JointQuery, KernelSide
from ..validation import check_int

_log = logging.getLogger("velox_core.kernels")
_DECLINED: set[tuple[str, str, str]] = set()  # (key codec, value codec, side) logged once

# the prefill's tiling (tiled_prefill_attention, prefill_tile, can_tile, TILE) is chosen per
# cache (VeloxCache.prefill_tile) and needs no name of its own in velox-core's face
__all__ = ["Segment", "attend", "partial"]


@dataclass
class Segment:
    """Stored tokens of one segment: key and value codecs with their records."""

    key_codec: Codec
    keys: Packed
    value_codec: Codec
    values: Packed

    @property
    def tokens(self) -> int:
        return self.keys.tokens


def _grouping(hq: int, segments: list[Segment]) -> tuple[int, int]:
    """The segments' KV heads ``H`` and the query heads a KV head ``R = hq / H``; raises
    unless ``hq`` is a multiple of ``H``."""
    h = segments[0].keys.data[next(iter(segments[0].keys.data))].shape[1]
    if hq % h:
        raise ValueError(f"attend: {hq} query heads is not a multiple of {h} KV heads")
    return h, hq // h


def decode_segments(segments: list[Segment], dtype: mx.Dtype) -> tuple[mx.array, mx.array]:
    """Keys and values of all segments decoded and joined along tokens.

    Shapes:
        returns ``(B, H, T, Dk)`` and ``(B, H, T, Dv)`` in ``dtype``.
    """
    ks = [s.key_codec.decode_as(s.keys, dtype) for s in segments]
    vs = [s.value_codec.decode_as(s.values, dtype) for s in segments]
    if len(ks) == 1:
        return ks[0], vs[0]
    return mx.concatenate(ks, axis=2), mx.concatenate(vs, axis=2)


def _shared_rotation(codecs: list[Codec]):
    """The one rotation the rotated codecs among ``codecs`` store in, or None (none, or
    several)."""
    rots = [r for r in (c.stored_rotation() for c in codecs) if r is not None]
    return rots[0] if rots and all(r is rots[0] for r in rots) else None


def _decode_in(codec: Codec, packed: Packed, rot, dtype: mx.Dtype) -> mx.array:
    """``packed`` decoded in ``dtype``, in ``rot``'s domain when ``rot`` is given."""
    if rot is None:
        return codec.decode_as(packed, dtype)
    if codec.stored_rotation() is rot:
        return codec.decode_rotated_as(packed, dtype)
    return rot.forward(codec.decode_as(packed, dtype)).astype(dtype)


def prefill_attention(
    queries: mx.array, segments: list[Segment], scale: float, mask=None, sinks=None
) -> mx.array:
    """Fused SDPA of many query tokens over the segments decoded in the model's dtype.

    Where the coded segments store rotated vectors (:meth:`Codec.stored_rotation`, one
    rotation a side), keys and values stay in the rotated domain: the queries are rotated,
    the other segments' few tokens (sinks, window) are rotated to match, and the output is
    rotated back, so no stored token is rotated back (``q . k = (R q) . (R k)``, and the
    inverse rotation is linear in the softmax-weighted sum of values).

    Shapes:
        queries ``(B, Hq, L, Dk)``; returns ``(B, Hq, L, Dv)`` in ``queries.dtype``.
    """
    dtype = queries.dtype
    rk = _shared_rotation([s.key_codec for s in segments])
    rv = _shared_rotation([s.value_codec for s in segments])
    if rk is None and rv is None:
        k, v = decode_segments(segments, dtype)
    else:
        ks = [_decode_in(s.key_codec, s.keys, rk, dtype) for s in segments]
        vs = [_decode_in(s.value_codec, s.values, rv, dtype) for s in segments]
        k = ks[0] if len(ks) == 1 else mx.concatenate(ks, axis=2)
        v = vs[0] if len(vs) == 1 else mx.concatenate(vs, axis=2)
        if rk is not None:
            queries = rk.forward(queries).astype(dtype)
    out = mx.fast.scaled_dot_product_attention(queries, k, v, scale=scale, mask=mask, sinks=sinks)
    return out if rv is None else rv.inverse(out).astype(dtype)


# -- prefill over slices of the stored tokens ---------------------------------------------

TILE = 256  # stored tokens decoded at once, where tiling is chosen automatically


def prefill_tile(
    setting: int | None,
    stored: int,
    query_shape: tuple[int, int, int, int] = (1, 1, 1, 128),
    kv_heads: int = 1,
    itemsize: int = 2,
) -> int:
    """Tokens per slice for a prefill chunk of queries ``query_shape`` (``(B, Hq, L, D)``, of
    ``itemsize`` bytes) over ``stored`` tokens of ``kv_heads`` heads, 0 for the fused path.

    ``setting`` None chooses from the bytes each path holds at once, on the CPU: the fused
    path at least the chunk x context scores in the queries' dtype and every stored key and
    value decoded, ``B * stored * (Hq * L + 2 * H * D) * itemsize``; the sliced path about
    two float32 score matrices of a slice, five float32 ``(Hq, L, D)`` running arrays and one
    slice's keys and values in float32, ``B * (Hq * L * (8 * TILE + 20 * D) + 8 * TILE * H *
    D)``. Slices of :data:`TILE` where those are fewer bytes, else 0; 0 on a GPU, whose fused
    SDPA does not materialize the scores. An int is used as given on every device (0: never
    slice). No more stored tokens than one slice are never sliced.
    """
    if setting is not None:
        check_int("prefill_tile", setting, minimum=0)
        return setting if stored > setting else 0
    if stored <= TILE or mx.default_device() != mx.cpu:
        return 0
    b, hq, lq, d = query_shape
    fused = b * stored * (hq * lq + 2 * kv_heads * d) * itemsize
    sliced = b * (hq * lq * (8 * TILE + 20 * d) + 8 * TILE * kv_heads * d)
    return TILE if sliced < fused else 0


def can_tile(segments: list[Segment]) -> bool:
    """Whether every segment's codecs decode block-aligned slices exactly."""
    return all(s.key_codec.decodes_slices and s.value_codec.decodes_slices for s in segments)


def _slices(segments: list[Segment], tile: int):
    """``(segment, start, stop)`` over the segments in temporal order: pieces of at most
    ``tile`` tokens (at least one block), aligned to the segment's key and value blocks."""
    for seg in segments:
        block = lcm(seg.keys.block, seg.values.block)
        step = max(block, tile // block * block)
        for a in range(0, seg.tokens, step):
            yield seg, a, min(seg.tokens, a + step)


def tiled_prefill_attention(
    queries: mx.array,
    segments: list[Segment],
    scale: float,
    mask=None,
    sinks: mx.array | None = None,
    tile: int = TILE,
) -> mx.array:
    """Attention of many query tokens over the segments, their stored tokens decoded ``tile``
    at a time (see the module). Masks and sinks as :func:`~velox_core.cache.attention.attend`;
    keys and values stay in a shared rotated domain where the coded segments store one
    (:meth:`Codec.stored_rotation`), as :func:`prefill_attention` does.

    Shapes:
        queries ``(B, Hq, L, Dk)``; returns ``(B, Hq, L, Dv)`` in ``queries.dtype``.
    """
    if tile < 1:
        raise ValueError(f"tiled_prefill_attention: tile must be at least 1, got {tile}")
    if not can_tile(segments):
        raise ValueError("tiled_prefill_attention: a segment's codec does not decode slices")
    dtype = queries.dtype
    b, hq, lq, dk = queries.shape
    h, r = _grouping(hq, segments)
    t = sum(s.tokens for s in segments)
    rk = _shared_rotation([s.key_codec for s in segments])
    rv = _shared_rotation([s.value_codec for s in segments])
    if rk is not None:
        queries = rk.forward(queries).astype(dtype)
    q = (queries.astype(mx.float32) * scale).reshape(b, h, r, lq, dk)
    causal = isinstance(mask, str)
    if causal and mask != "causal":
        raise ValueError(f"attention mask string must be 'causal', got {mask!r}")
    m5 = None if causal else _mask_5d(mask, b, h, r, lq, t)
    rows = (b, h, r, lq, 1)
    if sinks is None:
        m, l_sum = mx.full(rows, -mx.inf, dtype=mx.float32), mx.zeros(rows, dtype=mx.float32)
    else:  # the sink logit is a column of its own: m starts there, with exp(0) = 1 in l
        m = mx.broadcast_to(sinks.astype(mx.float32).reshape(1, h, r, 1, 1), rows)
        l_sum = mx.ones(rows, dtype=mx.float32)
    acc = None
    first_query = t - lq  # the position of the chunk's first query (causal masks)
    start = 0  # the global index of the current segment's first token
    current = None
    for seg, a, z in _slices(segments, tile):
        if seg is not current:
            if current is not None:
                start += current.tokens
            current = seg
        c0, c1 = start + a, start + z
        if causal and c1 - 1 > first_query:  # a slice reaching past the first query
            keep = mx.arange(first_query, t)[:, None] >= mx.arange(c0, c1)[None]
        else:
            keep = None if m5 is None else m5[..., c0:c1]
        k = _decode_in(seg.key_codec, seg.keys.slice(a, z), rk, dtype)
        v = _decode_in(seg.value_codec, seg.values.slice(a, z), rv, dtype)
        m, l_sum, acc = _step(q, k, v, keep, m, l_sum, acc)
        # this slice evaluated before the next one's graph exists; nothing of it but the
        # running state is referenced, so its scores are freed (or reused) as they are read
        mx.eval(m, l_sum, acc)
    out = (acc / l_sum).reshape(b, hq, lq, -1).astype(dtype)
    return out if rv is None else rv.inverse(out).astype(dtype)


def _step(q, k, v, keep, m, l_sum, acc):
    """One slice's online-softmax update of the running maximum, sum and output.

    Shapes:
        q ``(B, H, R, L, Dk)`` float32 scaled; k ``(B, H, S, Dk)``, v ``(B, H, S, Dv)``; keep
        None, a boolean or an additive mask broadcasting to ``(B, H, R, L, S)``; m and
        l_sum ``(B, H, R, L, 1)``, acc ``(B, H, R, L, Dv)`` (None before the first slice).
    """
    s = q @ mx.swapaxes(k, -1, -2)[:, :, None]  # (B, H, R, L, S) float32
    if keep is not None:
        s = mx.where(keep, s, -mx.inf) if keep.dtype == mx.bool_ else s + keep.astype(s.dtype)
    new_m = mx.maximum(m, mx.max(s, axis=-1, keepdims=True))
    shift = mx.where(new_m == -mx.inf, 0.0, new_m)  # rows that have seen nothing yet
    p = mx.exp(s - shift)
    alpha = mx.exp(m - shift)
    pv = p @ v[:, :, None]
    acc = pv if acc is None else acc * alpha + pv
    return new_m, l_sum * alpha + mx.sum(p, axis=-1, keepdims=True), acc


def _mask_5d(mask, b: int, h: int, r: int, lq: int, t: int) -> mx.array | None:
    """Bring an mlx-lm mask to ``(B|1, H|1, R|1, L, T)``; ``"causal"`` aligns bottom-right."""
    if mask is None:
        return None
    if isinstance(mask, str):
        if mask != "causal":
            raise ValueError(f"attention mask string must be 'causal', got {mask!r}")
        if lq == 1:
            return None
        qi = mx.arange(t - lq, t)[:, None]
        return qi >= mx.arange(t)[None]
    if mask.shape[-1] != t or mask.shape[-2] not in (1, lq):
        raise ValueError(
            f"attention mask of shape {tuple(mask.shape)} does not match {lq} queries over "
            f"{t} stored tokens"
        )
    if mask.ndim == 4:
        if mask.shape[1] == 1:
            return mx.expand_dims(mask, 2)
        if mask.shape[1] == h * r:
            return mask.reshape(mask.shape[0], h, r, *mask.shape[2:])
        raise ValueError(f"attention mask head axis {mask.shape[1]} is neither 1 nor {h * r}")
    if mask.ndim <= 2:
        return mask
    if mask.ndim == 3:
        return mask[:, None, None]
    raise ValueError(f"attention mask must have at most 4 dimensions, got {mask.ndim}")


def partial(q: mx.array, seg: Segment) -> tuple[mx.array, mx.array, mx.array]:
    """Unnormalized attention of grouped queries over one segment, for a log-sum-exp merge.

    Shapes:
        q ``(B, H, M, D)`` float32 with the scale applied; returns ``o`` ``(B, H, M, Dv)``
        (``sum_t exp(s_t - m) v_t``), ``m`` and ``l`` ``(B, H, M, 1)`` (the row max of the
        scores and ``sum_t exp(s_t - m)``), all float32.
    """
    s = seg.key_codec.scores(q, seg.keys)
    m = mx.max(s, axis=-1, keepdims=True)
    p = mx.exp(s - m)
    return seg.value_codec.mix(p, seg.values), m, mx.sum(p, axis=-1, keepdims=True)


def kernel_sides(
    key_codec: Codec, keys: Packed, value_codec: Codec, values: Packed, q_shape
) -> tuple[KernelSide, KernelSide] | None:
    """Whether a coded segment reaches the fused decode kernels, decided here alone: kernels
    on (:func:`velox_core.kernels.use_kernels`), the value codec's
    :meth:`~velox_core.Codec.kernel_values`, then the key codec's
    :meth:`~velox_core.Codec.kernel_keys` beside them. A codec pair that gives none takes the
    reference path, logged once per pair and side (``velox_core.kernels``, INFO)."""
    if not use_kernels():
        return None
    vs = value_codec.kernel_values(values, q_shape[-1])
    ks = None if vs is None else key_codec.kernel_keys(keys, q_shape, vs.record)
    if ks is not None:
        return ks, vs
    why = (key_codec.name, value_codec.name, "values" if vs is None else "keys")
    if why not in _DECLINED:
        _DECLINED.add(why)
        _log.info("no decode kernel for %s keys with %s values (their %s): reference path", *why)
    return None


def fused_partial(q: mx.array, seg: Segment):
    """This segment's partial from the fused decode kernels, or None (no kernel applies)."""
    sides = kernel_sides(seg.key_codec, seg.keys, seg.value_codec, seg.values, q.shape)
    return None if sides is None else segment_partial(q, *sides)


def joint_attention(
    q: mx.array, segments: list[Segment], out_dtype: mx.Dtype, scale: float | None = None
) -> mx.array | None:
    """Normalized attention over one coded segment and up to two fp16 (``Identity``) segments
    in one fused call (the coded segment's decode kernel and a merge that also attends the
    fp16 tokens), or None when the segments do not have that shape or no kernel applies.

    Shapes:
        q ``(B, H, M, D)`` float32 with the scale applied, or unscaled (any float dtype) with
        ``scale``; returns ``(B, H, M, Dv)`` in ``out_dtype``.
    """
    coded = [s for s in segments if not isinstance(s.key_codec, Identity)]
    plain = [s for s in segments if isinstance(s.key_codec, Identity)]
    if len(coded) != 1 or len(plain) > 2:
        return None
    if any(not isinstance(s.value_codec, Identity) for s in plain):
        return None
    seg = coded[0]
    sides = kernel_sides(seg.key_codec, seg.keys, seg.value_codec, seg.values, q.shape)
    if sides is None:
        return None
    fp16 = [(s.keys.data["x"], s.values.data["x"]) for s in plain]
    tokens = sum(k.shape[2] for k, _ in fp16)
    run = plan_segment(JointQuery(tuple(q.shape), q.dtype, tokens, out_dtype, scale), *sides)
    return None if run is None else run(q, fp16)


def merge_partials(parts: list[tuple[mx.array, mx.array, mx.array]]) -> mx.array:
    """Normalized attention from per-segment partials: one softmax over all of them.

    Shapes:
        each part as returned by :func:`partial`; returns float32 ``(B, H, M, Dv)``.
    """
    if len(parts) == 1:  # one segment: its partial is already relative to its own max
        o, _, li = parts[0]
        return o / li
    m = parts[0][1]
    for _, mi, _ in parts[1:]:
        m = mx.maximum(m, mi)
    num, den = None, None
    for o, mi, li in parts:
        w = mx.exp(mi - m)
        num = o * w if num is None else num + o * w
        den = li * w if den is None else den + li * w
    return num / den


def attend(
    queries: mx.array,
    segments: list[Segment],
    scale: float,
    mask=None,
    sinks: mx.array | None = None,
    fused_above: int = 16,
    tile: int | None = None,
) -> mx.array:
    """``softmax(q k^T * scale + mask) v`` over the segments' tokens, in ``queries.dtype``.

    Args:
        queries: ``(B, Hq, L, Dk)``, post-RoPE.
        segments: stored tokens in temporal order (sinks, body, window).
        scale: the model's attention scale.
        mask: None, ``"causal"``, or an mlx-lm boolean/additive mask over stored tokens.
        sinks: optional per-head sink logits ``(Hq,)`` (an extra softmax column, as in
            mlx-lm's SDPA).
        fused_above: query lengths above this decode the segments and use fused SDPA, or
            attend over slices of the stored tokens (:func:`tiled_prefill_attention`).
        tile: stored tokens per slice for those: None chooses (:func:`prefill_tile`: slices
            on the CPU, where fused SDPA materializes the scores, where they hold fewer
            bytes), 0 never slices; only segments whose codecs decode slices
            (:attr:`Codec.decodes_slices`) are sliced.

    Shapes:
        returns ``(B, Hq, L, Dv)``.
    """
    b, hq, lq, _ = queries.shape
    if not segments:
        raise ValueError("attend: the cache holds no tokens")
    if lq > fused_above:
        n = 0
        if can_tile(segments):
            h = segments[0].keys.data[next(iter(segments[0].keys.data))].shape[1]
            stored = sum(s.tokens for s in segments)
            n = prefill_tile(tile, stored, queries.shape, h, queries.dtype.size)
        if n:
            return tiled_prefill_attention(queries, segments, scale, mask, sinks, n)
        return prefill_attention(queries, segments, scale, mask, sinks)
    h, r = _grouping(hq, segments)
    fused = (mask is None or lq == 1) and sinks is None and use_kernels()
    if fused:
        # the unscaled queries: the kernels apply the scale
        out = joint_attention(queries.reshape(b, h, r * lq, -1), segments, queries.dtype, scale)
        if out is not None:
            return out.reshape(b, hq, lq, -1)
    q = (queries.astype(mx.float32) * scale).reshape(b, h, r * lq, -1)
    if fused:
        parts = [fused_partial(q, seg) for seg in segments]
        if any(p is not None for p in parts):
            parts = [p if p is not None else partial(q, seg) for p, seg in zip(parts, segments)]
            return merge_partials(parts).reshape(b, hq, lq, -1).astype(queries.dtype)
    return _reference(queries, segments, scale, mask, sinks)[0]


def attend_weights(
    queries: mx.array, segments: list[Segment], scale: float, mask=None
) -> tuple[mx.array, mx.array]:
    """:func:`attend` for a few queries on its reference path, with the softmax weights it
    computes: for a retention policy that scores stored tokens by this call's attention
    (``RetentionPolicy.wants_weights``), so that the weights are not computed again beside
    the call. The weights are each query's softmax over every stored token it sees (the
    scores from the key codecs, as attention reads them; masked tokens weigh 0).

    Shapes:
        queries ``(B, Hq, L, Dk)``; returns the output ``(B, Hq, L, Dv)`` in
        ``queries.dtype`` and the weights, float32 ``(B, H, R, L, S)`` (``R = Hq / H`` query
        heads a KV head, mlx-lm's grouped layout; ``S`` the stored tokens in the segments'
        order).
    """
    if not segments:
        raise ValueError("attend: the cache holds no tokens")
    out, p = _reference(queries, segments, scale, mask, None)
    b, h, _, t = p.shape
    return out, p.reshape(b, h, -1, queries.shape[2], t)


def _reference(queries, segments, scale, mask, sinks) -> tuple[mx.array, mx.array]:
    """The reference path of a few queries: the key codecs' scores, one softmax, the value
    codecs' mix. Returns the output ``(B, Hq, L, Dv)`` and the weights, float32 ``(B, H, R *
    L, S)`` (the sink column, if any, left out)."""
    b, hq, lq, _ = queries.shape
    h, r = _grouping(hq, segments)
    t = sum(s.tokens for s in segments)
    q = (queries.astype(mx.float32) * scale).reshape(b, h, r * lq, -1)
    scores = [s.key_codec.scores(q, s.keys) for s in segments]
    s = scores[0] if len(scores) == 1 else mx.concatenate(scores, axis=-1)  # (B, H, R*L, T)
    m5 = _mask_5d(mask, b, h, r, lq, t)
    if m5 is not None:
        s = s.reshape(b, h, r, lq, t)
        if m5.dtype == mx.bool_:
            s = mx.where(m5, s, -mx.inf)
        else:
            s = s + m5.astype(mx.float32)
        s = s.reshape(b, h, r * lq, t)
    if sinks is not None:
        sk = mx.broadcast_to(sinks.astype(mx.float32).reshape(1, h, r, 1, 1), (b, h, r, lq, 1))
        s = mx.concatenate([sk.reshape(b, h, r * lq, 1), s], axis=-1)
    p = mx.softmax(s, axis=-1, precise=True)
    if sinks is not None:
        p = p[..., 1:]
    out, start = None, 0
    for seg in segments:  # (one segment: every weight is its own, unsliced)
        w = p if len(segments) == 1 else p[..., start : start + seg.tokens]
        part = seg.value_codec.mix(w, seg.values)
        out = part if out is None else out + part
        start += seg.tokens
    return out.reshape(b, hq, lq, -1).astype(queries.dtype), p
