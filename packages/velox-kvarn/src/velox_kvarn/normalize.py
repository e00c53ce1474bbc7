"""KVarN's dual-scaling variance normalization of a tile (arXiv 2606.03458).

A tile is ``group`` consecutive tokens of one KV head, all its (rotated) channels: a matrix
``X`` of shape ``(G, D)``. KVarN looks for a per-token scale ``t`` and a per-channel scale
``c`` such that ``X / (t c^T)`` has the same standard deviation along every token and every
channel, by alternating the two normalizations, Sinkhorn-like, in the log domain:

- one half-step divides each token (row) by its standard deviation over the channels;
- the other divides each channel (column) by its standard deviation over the tokens;
- keys start with the tokens, values with the channels (the authors' tiles are ``(D, G)`` for
  keys and ``(G, D)`` for values, and both begin with the matrix's columns);
- each standard deviation is the unbiased one (``n - 1``), clipped to ``[1e-3, 1e3]`` before
  its log is added to the running log scale, and every log scale is clamped to
  ``[-0.3, 10]`` (so a scale lies in ``[0.74, 22026]``: an fp16 number);
- after every iteration (both half-steps) the tile's *imbalance*, ``max/min`` of the token
  deviations plus ``max/min`` of the channel deviations (2 when perfectly balanced), is
  compared with the best seen (the identity scales included), and the scales of the lowest
  imbalance are the ones returned.

The clip and clamp constants and the best-so-far rule are those of the authors' vLLM
reference (``vllm/model_executor/layers/quantization/kvarn/sinkhorn.py``). The clamp makes the
normalization depend on the tile's absolute scale: it never scales a token or channel up by
more than ``e^0.3`` (1.35x), so a tile whose deviations are all below about 0.74 is only
partly equalized.
"""

from __future__ import annotations

import mlx.core as mx

__all__ = ["LOG_MAX", "LOG_MIN", "ORDERS", "STD_MAX", "STD_MIN", "imbalance", "normalize"]

STD_MIN, STD_MAX = 1e-3, 1e3  # a half-step's deviation is clipped to this range
LOG_MIN, LOG_MAX = -0.3, 10.0  # every log scale is clamped to this range
_FLOOR = 1e-8  # the imbalance's smallest divisor

# the half-steps of one iteration: keys normalize tokens first, values channels first
ORDERS = {"key": ("token", "channel"), "value": ("channel", "token")}


def _std(x: mx.array, axis: int) -> mx.array:
    """Unbiased standard deviation along ``axis``, kept as a size-1 axis (float32)."""
    n = x.shape[axis]
    mean = mx.mean(x, axis=axis, keepdims=True)
    return mx.sqrt(mx.sum(mx.square(x - mean), axis=axis, keepdims=True) / (n - 1))


def imbalance(x: mx.array) -> mx.array:
    """``max/min`` of the token deviations plus ``max/min`` of the channel deviations.

    Shapes:
        x float32 ``(..., G, D)``; returns float32 ``(..., 1, 1)``.
    """
    tok = _std(x, -1)  # (..., G, 1): each token over the channels
    chan = _std(x, -2)  # (..., 1, D): each channel over the tokens

    def spread(s: mx.array) -> mx.array:
        hi = mx.max(s, axis=(-2, -1), keepdims=True)
        return hi / mx.maximum(mx.min(s, axis=(-2, -1), keepdims=True), _FLOOR)

    return spread(tok) + spread(chan)


def _step(log: mx.array, std: mx.array) -> mx.array:
    return mx.clip(log + mx.log(mx.clip(std, STD_MIN, STD_MAX)), LOG_MIN, LOG_MAX)


def normalize(x: mx.array, iters: int, side: str) -> tuple[mx.array, mx.array]:
    """The log scales of KVarN's normalization of each tile, the best of ``iters`` iterations.

    Args:
        x: float32 tiles ``(..., G, D)`` (tokens by rotated channels).
        iters: iterations (each a token and a channel half-step); 0 keeps the identity.
        side: ``"key"`` (tokens first) or ``"value"`` (channels first).

    Returns:
        ``(log_tok, log_chan)``: float32 ``(..., G, 1)`` and ``(..., 1, D)``, such that
        ``x * exp(-(log_tok + log_chan))`` is the balanced tile.
    """
    order = ORDERS[side]
    log_tok = mx.zeros((*x.shape[:-1], 1), dtype=mx.float32)
    log_chan = mx.zeros((*x.shape[:-2], 1, x.shape[-1]), dtype=mx.float32)
    best_tok, best_chan, best = log_tok, log_chan, imbalance(x)
    for _ in range(iters):
        for axis in order:
            cur = x * mx.exp(-(log_tok + log_chan))
            if axis == "token":
                log_tok = _step(log_tok, _std(cur, -1))
            else:
                log_chan = _step(log_chan, _std(cur, -2))
        imb = imbalance(x * mx.exp(-(log_tok + log_chan)))
        better = imb <= best  # ties take the later scales, as the reference does
        best_tok = mx.where(better, log_tok, best_tok)
        best_chan = mx.where(better, log_chan, best_chan)
        best = mx.where(better, imb, best)
    return best_tok, best_chan
