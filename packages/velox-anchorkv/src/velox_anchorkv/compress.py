"""One layer's prompt compressed into AnchorKV's records (arXiv 2608.02901, Section 3).

:func:`compress_prompt` runs the paper's three steps on the exact prompt, per layer and KV
head: anchors (:func:`~velox_anchorkv.anchors.choose_anchors`), every token's projection on
its anchor, keys before RoPE (:func:`~velox_anchorkv.anchors.project`), and the residuals
the byte budget buys, ranked by their utility across the layer's KV heads
(:func:`~velox_anchorkv.anchors.utilities`, :func:`~velox_anchorkv.anchors.residual_slots`),
coded by :class:`~velox_anchorkv.residual.ResidualCodec`.
"""

from __future__ import annotations

from typing import NamedTuple

import mlx.core as mx
import numpy as np

from velox_core import Packed
from velox_core.ops.rope import fast_rotate

from .anchors import choose_anchors, observe, project, residual_slots, utilities
from .codec import AnchorKeys, AnchorValues

__all__ = ["Compressed", "compress_prompt"]

FP16 = 2  # bytes of an fp16 coordinate: theta is a share of the fp16 cache
ROWS = 4096  # residuals coded at once


class Compressed(NamedTuple):
    """The two records and what the budget bought.

    Attributes:
        keys, values: the records (:mod:`velox_anchorkv.codec`).
        anchors: anchors per KV head (``k``).
        key_residuals, value_residuals: residuals per batch row (``N_K``, ``N_V``).
    """

    keys: Packed
    values: Packed
    anchors: int
    key_residuals: int
    value_residuals: int


def _top(u: mx.array, n: int) -> mx.array:
    """The ``n`` slots (``head * S + token``) of largest utility per batch row, ascending.

    Shapes: u ``(B, H, S)``; returns int32 ``(B, n)``.
    """
    b = u.shape[0]
    flat = u.reshape(b, -1)
    if n == 0:
        return mx.zeros((b, 0), dtype=mx.int32)
    idx = mx.argpartition(-flat, kth=n - 1, axis=-1)[:, :n] if n < flat.shape[1] else None
    if idx is None:
        idx = mx.broadcast_to(mx.arange(flat.shape[1]), flat.shape)
    return mx.sort(idx, axis=-1).astype(mx.int32)


def _code(side, res: mx.array, slot: mx.array) -> tuple[mx.array, mx.array]:
    """The residuals of ``slot`` coded, ``ROWS`` at a time (each tile evaluated before the
    next: the encode's intermediates stay a tile's): codes ``(B, N, words)``, scales
    ``(B, N)``."""
    b, h, s, d = res.shape
    if slot.shape[-1] == 0:  # nothing to code (the record leaves the residual arrays out)
        return mx.zeros((b, 0, 1), dtype=mx.uint32), mx.zeros((b, 0), dtype=mx.float16)
    flat = res.reshape(b, h * s, d)
    codes, scales = [], []
    for n0 in range(0, slot.shape[-1], ROWS):
        rows = mx.take_along_axis(flat, slot[:, n0 : n0 + ROWS, None], axis=1)
        c, sc = side.residual_codec(d).encode(rows)
        mx.eval(c, sc)
        codes.append(c)
        scales.append(sc)
    return mx.concatenate(codes, axis=1), mx.concatenate(scales, axis=1)


def compress_prompt(
    keys: mx.array,
    values: mx.array,
    queries: mx.array,
    q_pos: mx.array,
    scale: float,
    cfg,
    key_side: AnchorKeys,
    value_side: AnchorValues,
    rng: np.random.Generator,
) -> Compressed:
    """The records of a prompt at positions ``0 ... S-1``.

    Args:
        keys, values: the exact prompt, keys post-RoPE ``(B, H, S, D)``, ``(B, H, S, Dv)``.
        queries: the observation queries, post-RoPE ``(B, Hq, n, D)``, at ``q_pos`` ``(n,)``.
        scale: the model's attention scale.
        cfg: the :class:`~velox_anchorkv.AnchorKVConfig` (``theta``, ``window``,
            ``anchors``, ``rho``).
        key_side, value_side: the readers (their RoPE and residual codecs).
        rng: the random anchors' generator.
    """
    dtype = keys.dtype
    _, h, s, dk = keys.shape
    dv = values.shape[-1]
    obs = observe(queries, q_pos, keys, values, scale)
    at = choose_anchors(obs.votes, cfg.window, cfg.anchors, cfg.rho, rng)
    k = at.shape[-1]
    # evaluated step by step, so that each step's float32 intermediates (of the prompt's
    # size) are freed before the next step's exist
    pre = fast_rotate(keys, mx.zeros((1,), mx.int32), key_side.rope_for(dk), inverse=True)
    pk = project(pre, at, dtype)
    mx.eval(pk)
    del pre
    pv = project(values, at, dtype)
    mx.eval(pv)
    # the key residual's utility reads it after RoPE (R_t r: what a score sees)
    post = fast_rotate(pk.residual, mx.zeros((1,), mx.int32), key_side.rope_for(dk))
    u_k, u_v = utilities(obs, values, post, pv.residual)
    mx.eval(u_k, u_v)
    del obs, post
    kres, vres = key_side.residual_codec(dk), value_side.residual_codec(dv)
    meta = (2 if k <= 32767 else 4) + 2  # index and gamma, per token and side
    full = cfg.theta * FP16 * h * s * (dk + dv)
    base = h * k * (dk + dv) * dtype.size + 2 * h * s * meta
    nk, nv = residual_slots(full, base, kres.slot_bytes, vres.slot_bytes, h * (s - k))
    slot_k, slot_v = _top(u_k, nk), _top(u_v, nv)
    ck, sk = _code(key_side, pk.residual, slot_k)
    cv, sv = _code(value_side, pv.residual, slot_v)
    return Compressed(
        key_side.record(pk, ck, sk, slot_k),
        value_side.record(pv, cv, sv, slot_v),
        k,
        nk,
        nv,
    )
