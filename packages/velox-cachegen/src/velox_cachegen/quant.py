"""CacheGen's quantization of one layer's keys (or values) over one chunk of tokens.

The paper (arXiv 2310.07240, Sec. 5.1) groups a chunk's tokens into groups of ``group``
contiguous tokens; the first of each group is its *anchor*, quantized finely, and every other
token is coded as its *delta* from the anchor (not from the previous token, so that every
token of a group decodes at once). The quantization step of the deltas is set per layer
(layer-wise quantization, :mod:`velox_cachegen.levels`).

velox codes one layer-side of a chunk as the tokens' vectors ``x`` of ``C = heads x head_dim``
channels, centred on the chunk's per-channel mean (stored in float16). ``delta`` chooses the
prediction per channel: ``"anchor"`` codes every channel as anchors and deltas (the paper),
``"none"`` codes every token by itself (the public reference code), ``"auto"`` picks, per
channel, whichever of the two gives fewer bits on this chunk (one flag per channel). A delta
is taken from the anchor as decoded (closed loop), so the errors of anchor and delta do not
add up. Every symbol is a uniform quantizer's index: ``round(value / step)``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

__all__ = ["DELTAS", "Quantized", "anchors", "dequantize", "quantize", "spread_of"]

DELTAS = ("auto", "anchor", "none")


@dataclass(frozen=True)
class Quantized:
    """One layer-side of one chunk. ``mean`` ``(C,)`` float16, ``step`` (float32: the
    deltas' and plain tokens' step; anchors use ``step * anchor_step``), ``delta`` ``(C,)``
    bool (channels coded as anchor + delta), ``symbols`` ``(B, n, C)`` int32 (at an anchor
    position of a delta channel: the anchor's symbol)."""

    mean: np.ndarray
    step: np.float32
    delta: np.ndarray
    symbols: np.ndarray


def anchors(n: int, group: int) -> np.ndarray:
    """``(n,)`` bool: the anchor positions of a chunk of ``n`` tokens (every ``group``-th,
    from the chunk's first)."""
    return np.arange(n) % group == 0


def spread_of(x: np.ndarray) -> float:
    """Root-mean-square of ``x`` ``(B, n, C)`` around its float16-rounded per-channel mean
    (what :func:`quantize` centres on): the unit of a level's steps."""
    mean = x.reshape(-1, x.shape[-1]).mean(axis=0).astype(np.float16).astype(np.float32)
    return float(np.sqrt(np.mean(np.square(x - mean), dtype=np.float64)))


def _round(x: np.ndarray) -> np.ndarray:
    return np.rint(x).astype(np.int64)


def _bits(symbols: np.ndarray) -> np.ndarray:
    """Per-channel empirical entropy (bits) of ``(N, C)`` symbols under a table per channel."""
    if symbols.shape[0] == 0:
        return np.zeros(symbols.shape[1])
    lo = symbols.min(axis=0)
    span = int((symbols.max(axis=0) - lo).max()) + 1
    c = symbols.shape[1]
    flat = (symbols - lo) + np.arange(c) * span
    counts = np.bincount(flat.ravel(), minlength=c * span).reshape(c, span).astype(np.float64)
    n = symbols.shape[0]
    with np.errstate(divide="ignore", invalid="ignore"):
        h = -np.where(counts > 0, counts * np.log2(counts / n), 0.0)
    return h.sum(axis=1)


def quantize(x: np.ndarray, step: float, anchor_step: float, group: int, delta: str) -> Quantized:
    """Quantize one layer-side of a chunk.

    Shapes:
        x ``(B, n, C)`` float32 (batch rows, the chunk's tokens, channels).
    """
    _b, n, c = x.shape
    mean = x.reshape(-1, c).mean(axis=0).astype(np.float16)
    xc = x - mean.astype(np.float32)
    step = np.float32(step)
    fine = np.float32(step * np.float32(anchor_step))
    plain = _round(xc / step)
    is_a = anchors(n, group)
    if delta == "none" or n < 2:
        return Quantized(mean, step, np.zeros(c, bool), plain.astype(np.int32))
    a_sym = _round(xc[:, is_a] / fine)
    a_hat = a_sym.astype(np.float32) * fine
    pred = np.repeat(a_hat, group, axis=1)[:, :n]
    res = _round((xc - pred) / step)
    res[:, is_a] = a_sym
    if delta == "anchor":
        use = np.ones(c, bool)
    else:
        flat = lambda a: a.reshape(-1, c)  # noqa: E731
        cost_plain = _bits(flat(plain))
        cost_delta = _bits(flat(a_sym)) + _bits(flat(res[:, ~is_a]))
        use = cost_delta < cost_plain
    symbols = np.where(use, res, plain).astype(np.int32)
    return Quantized(mean, step, use, symbols)


def dequantize(q: Quantized, anchor_step: float, group: int) -> np.ndarray:
    """The values :func:`quantize` coded: ``(B, n, C)`` float32."""
    _b, n, _c = q.symbols.shape
    step = np.float32(q.step)
    fine = np.float32(step * np.float32(anchor_step))
    s = q.symbols.astype(np.float32)
    out = s * step
    if q.delta.any():
        is_a = anchors(n, group)
        a_hat = s[:, is_a] * fine
        pred = np.repeat(a_hat, group, axis=1)[:, :n]
        out = np.where(q.delta, pred + s * step, out)
        out[:, is_a] = np.where(q.delta, a_hat, out[:, is_a])
    return out + q.mean.astype(np.float32)
