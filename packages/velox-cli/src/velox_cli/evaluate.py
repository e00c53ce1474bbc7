"""Evaluation of any cache on any mlx-lm model: quality, retrieval, memory and speed.

* Quality on the decode path: prefill a prefix (in chunks, as ``mlx_lm.generate`` does) with
  the cache under test, then teacher-force a continuation one token at a time; compare each
  step's next-token distribution with the fp16 cache's on the same tokens: mean
  ``KL(p_fp16 || p_cache)``, top-1 agreement, and the perplexity of the continuation.
* Retrieval: recall prompts (:func:`velox_cli.data.recall_prompts`), greedy decoding, exact
  match of the value.
* Memory: the caches' resident bytes (``nbytes``: every array they hold, capacity included)
  after the prefix and continuation, per token and against the fp16 cache measured on the
  same tokens; MLX's peak memory during the first sample's chunked prefill and over the whole
  run, and its active memory after the first sample (weights included).
* Speed: prefill and decode tokens per second.
* Finiteness: how many teacher-forced steps gave a next-token distribution holding a NaN or
  an inf, and how many layers' caches hold one after the first sample (their KL, top-1 and
  perplexity are then NaN, and the table says why).

Attention is routed to velox caches (:func:`velox_core.routed`) for every run.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import mlx.core as mx
import numpy as np

from velox_core import routed

from .data import RecallPrompt

__all__ = [
    "Reference",
    "Row",
    "decode_quality",
    "nonfinite_layers",
    "prefill",
    "reference_run",
    "retrieval",
    "teacher_force",
]


def prefill(model, caches: list, tokens, chunk: int = 512) -> mx.array:
    """Feed ``tokens`` through the model in chunks; returns the last position's logits."""
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


@dataclass
class Reference:
    """The fp16 cache's distributions and bytes on the evaluation samples."""

    logprobs: list[np.ndarray]
    cache_bytes: int
    tokens: int


@dataclass
class Row:
    """One spec's results (the fields of ``velox bench --json``)."""

    spec: str
    method: str
    params: dict[str, Any]
    context: int
    cache_bytes: int = 0
    bytes_per_token: float = 0.0
    compression_ratio: float = 0.0
    kl: float = float("nan")
    top1: float = float("nan")
    ppl: float = float("nan")
    retrieval: float = float("nan")
    retrieval_by_length: dict[str, float] = field(default_factory=dict)
    prefill_tps: float = 0.0
    decode_tps: float = 0.0
    peak_memory: int = 0
    prefill_peak_memory: int = 0
    active_memory: int = 0
    tokens: int = 0
    nonfinite_steps: int = 0  # teacher-forced steps (all samples) with NaN/inf log-probs
    nonfinite_layers: int = 0  # layers whose cache holds a NaN/inf after the first sample
    error: str | None = None

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        return {k: (None if isinstance(v, float) and math.isnan(v) else v) for k, v in out.items()}


def _run_sample(model, caches, prefix, cont, chunk) -> tuple[np.ndarray, float, float, int]:
    mx.clear_cache()
    mx.reset_peak_memory()
    t0 = time.perf_counter()
    with routed(model):
        logits = prefill(model, caches, prefix, chunk)
        t1 = time.perf_counter()
        peak = int(mx.get_peak_memory())
        lp = teacher_force(model, caches, logits, cont)
    t2 = time.perf_counter()
    return lp, t1 - t0, t2 - t1, peak


def reference_run(model, make_caches: Callable[[], list], samples, chunk: int = 512) -> Reference:
    """The fp16 run every other spec is compared with."""
    lps, nbytes, tokens = [], 0, 0
    for i, (prefix, cont) in enumerate(samples):
        caches = make_caches()
        lp, _, _, _ = _run_sample(model, caches, prefix, cont, chunk)
        lps.append(lp)
        if i == 0:
            nbytes = sum(c.nbytes for c in caches)
            tokens = caches[0].offset
    return Reference(lps, nbytes, tokens)


def decode_quality(
    model, make_caches: Callable[[], list], samples, ref: Reference, row: Row, chunk: int = 512
) -> None:
    """Fill ``row`` with KL, top-1, perplexity, bytes and speed over ``samples``."""
    kls, agree, nll, steps = [], 0, 0.0, 0
    pre_t = dec_t = 0.0
    pre_n = dec_n = 0
    for i, (prefix, cont) in enumerate(samples):
        caches = make_caches()
        lp, tp, td, peak = _run_sample(model, caches, prefix, cont, chunk)
        if i == 0:
            row.prefill_peak_memory = peak
            row.cache_bytes = int(sum(c.nbytes for c in caches))
            row.tokens = int(caches[0].offset)
            row.active_memory = int(mx.get_active_memory())
            row.nonfinite_layers = nonfinite_layers(caches)
        row.nonfinite_steps += int(np.sum(~np.all(np.isfinite(lp), axis=-1)))
        pre_t, pre_n = pre_t + tp, pre_n + len(prefix)
        dec_t, dec_n = dec_t + td, dec_n + len(cont) - 1
        p = np.exp(ref.logprobs[i])
        kls.extend(np.sum(p * (ref.logprobs[i] - lp), axis=-1).tolist())
        agree += int(np.sum(np.argmax(lp, -1) == np.argmax(ref.logprobs[i], -1)))
        nll -= float(np.sum(lp[np.arange(len(cont)), np.asarray(cont)]))
        steps += len(cont)
        del caches
    row.kl = float(np.mean(kls))
    row.top1 = agree / steps
    row.ppl = math.exp(nll / steps)
    row.prefill_tps = pre_n / pre_t if pre_t else 0.0
    row.decode_tps = dec_n / dec_t if dec_t else 0.0
    row.bytes_per_token = row.cache_bytes / max(row.tokens, 1)
    if row.tokens == ref.tokens and row.cache_bytes:
        row.compression_ratio = ref.cache_bytes / row.cache_bytes


def nonfinite_layers(caches: list) -> int:
    """Layers whose cache holds a NaN or an inf in any floating-point array of its state
    (tokens kept as given, scales, norms, fitted codec arrays; any cache class)."""

    def arrays(x):
        if isinstance(x, mx.array):
            yield x
        elif isinstance(x, (list, tuple)):
            for y in x:
                yield from arrays(y)

    flags = []
    for c in caches:
        fl = [a for a in arrays(c.state) if mx.issubdtype(a.dtype, mx.floating)]
        flags.append(
            mx.array(True) if not fl else mx.all(mx.stack([mx.all(mx.isfinite(a)) for a in fl]))
        )
    return sum(not ok for ok in mx.stack(flags).tolist()) if flags else 0


def retrieval(
    model, tokenizer, make_caches: Callable[[], list], prompts: list[RecallPrompt], chunk: int = 512
) -> tuple[float, dict[str, float]]:
    """Exact-match accuracy of greedy answers to recall prompts (overall and per length)."""
    hits: dict[int, list[bool]] = {}
    for p in prompts:
        caches = make_caches()
        with routed(model):
            logits = prefill(model, caches, p.tokens, chunk)
            out = []
            for _ in range(p.answer_tokens):
                y = mx.argmax(logits, axis=-1)
                out.append(int(y.item()))
                logits = model(y[:, None], cache=caches)[:, -1]
        hits.setdefault(p.length, []).append(p.correct(tokenizer.decode(out)))
    flat = [h for v in hits.values() for h in v]
    return (
        sum(flat) / len(flat) if flat else float("nan"),
        {str(k): sum(v) / len(v) for k, v in sorted(hits.items())},
    )
