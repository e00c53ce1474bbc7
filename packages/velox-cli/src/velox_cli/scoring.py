"""Teacher-forced scoring of caches on a model: prefill, forced decode steps, KL, held bytes.

The pieces ``velox bench`` (``velox_cli.evaluate``), ``velox eval`` and the per-layer bit
allocator (:mod:`velox_cli.allocator`) measure caches with, so that all of them count the
same way: a prompt prefilled in chunks as mlx-lm prefills, a continuation fed one token at a
time on the decode path, the KL divergence of each step's next-token distribution from a
reference run's, and the bytes of the tokens a cache holds (:func:`held_bytes`).

Callers route attention to velox caches (:func:`velox_core.routed`) around these calls.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import numpy as np

__all__ = ["held_bytes", "kl_rows", "prefill", "teacher_force"]


def held_bytes(cache: Any) -> int:
    """Bytes of the tokens a cache holds, counted the same way for every cache class: a velox
    cache's buffers without their unused capacity (plus fitted and policy state), and for
    mlx-lm's ``KVCache`` / ``QuantizedKVCache`` / ``RotatingKVCache`` the slices of their
    buffers that hold tokens (mlx-lm allocates 256 tokens at a time)."""
    if hasattr(cache, "logical_nbytes"):
        return int(cache.logical_nbytes)
    keys, values = getattr(cache, "keys", None), getattr(cache, "values", None)
    offset = getattr(cache, "offset", None)
    if keys is None or not isinstance(offset, int):
        return int(getattr(cache, "nbytes", 0))

    def part(x) -> int:
        if isinstance(x, (tuple, list)):
            return sum(part(y) for y in x)
        n = min(offset, x.shape[-2])
        return x[..., :n, :].nbytes

    return part(keys) + part(values)


def prefill(model, caches: list, tokens, chunk: int = 512) -> mx.array:
    """Feed ``tokens`` through the model in chunks; returns the last position's logits.

    Shapes: tokens ``(T,)`` ints; returns ``(1, vocab)``.
    """
    tokens = mx.array(np.asarray(tokens, dtype=np.int32))
    logits = None
    for s in range(0, tokens.size, chunk):
        logits = model(tokens[None, s : s + chunk], cache=caches)[:, -1]
        mx.eval(logits, [c.state for c in caches])
    return logits


def teacher_force(model, caches: list, first_logits: mx.array, tokens) -> np.ndarray:
    """Log-probabilities of every step of a forced continuation.

    Returns:
        float32 ``(len(tokens), vocab)``: row ``i`` is the distribution that predicts
        ``tokens[i]`` (row 0 from ``first_logits``).
    """
    rows = []
    logits = first_logits
    for i, t in enumerate(tokens):
        lp = logits.astype(mx.float32) - mx.logsumexp(
            logits.astype(mx.float32), axis=-1, keepdims=True
        )
        rows.append(lp)
        if i + 1 < len(tokens):
            logits = model(mx.array([[int(t)]]), cache=caches)[:, -1]
        mx.eval(rows[-1], logits)
    return np.concatenate([np.array(r) for r in rows], axis=0)


def kl_rows(ref: np.ndarray, logprobs: np.ndarray) -> np.ndarray:
    """``KL(p_ref || p)`` of each row: natural log-probabilities ``(steps, vocab)`` of a
    reference run and of the run scored, each row a distribution; returns ``(steps,)``."""
    return np.sum(np.exp(ref) * (ref - logprobs), axis=-1)
