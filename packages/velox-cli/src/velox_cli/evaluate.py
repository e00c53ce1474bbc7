"""Evaluation of any cache on any mlx-lm model: quality, retrieval, memory and speed.

* Quality on the decode path: prefill a prefix (in chunks, as ``mlx_lm.generate`` does) with
  the cache under test, then teacher-force a continuation one token at a time; compare each
  step's next-token distribution with the fp16 cache's on the same tokens: mean
  ``KL(p_fp16 || p_cache)``, top-1 agreement, and the perplexity of the continuation. A
  method with a step after the prefill (:func:`after_prefill`: KVzip's reconstruction) takes
  it between the prefix and the continuation, and its time counts in the prefill's.
* Retrieval: recall prompts (:func:`velox_cli.data.recall_prompts`), greedy decoding, exact
  match of the value.
* Memory: the bytes of the tokens the caches hold after the prefix and continuation
  (:func:`held_bytes`, counted the same way for every cache, fp16 and mlx-lm's quantized
  caches included: the rows of every array that hold tokens, with a velox cache's fitted
  and policy state, without the buffers' unused capacity), per token and against the fp16
  cache's on the same tokens; the resident bytes beside them (``nbytes``: capacity
  included, where mlx-lm allocates 256 tokens at a time); MLX's peak memory during the first
  sample's chunked prefill and over the whole run, and its active memory after the first
  sample (weights included).
* Speed: prefill and decode tokens per second.
* Finiteness: how many teacher-forced steps gave a next-token distribution holding a NaN or
  an inf, and how many layers' caches hold one after the first sample (their KL, top-1 and
  perplexity are then NaN, and the table says why).

Attention is routed to velox caches (:func:`velox_core.routed`) for every run. The prefill,
the forced steps, the KL and the held bytes are :mod:`velox_cli.scoring`'s, which velox's
per-layer bit allocator (:mod:`velox_cli.allocator`) measures with too.
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
from .scoring import held_bytes, kl_rows, prefill, teacher_force

__all__ = [
    "Reference",
    "Row",
    "after_prefill",
    "decode_quality",
    "held_bytes",
    "nonfinite_layers",
    "prefill",
    "reference_run",
    "retrieval",
    "rows_from_json",
    "teacher_force",
]


def after_prefill(model, tokenizer, caches: list, tokens) -> None:
    """Run the step a method takes once a prompt is prefilled, where it has one: the class of
    a cache's retention policy may define ``after_prefill(model, tokenizer, caches, tokens)``
    (KVzip's: the context reconstructed and the cache cut once, ``velox_kvzip.compress``).
    Each such step runs once, over every layer's caches, with the prefilled ``tokens``."""
    steps = []
    for c in caches:
        step = getattr(type(getattr(c, "policy", None)), "after_prefill", None)
        if step is not None and step not in steps:
            steps.append(step)
    for step in steps:
        step(model, tokenizer, caches, tokens)


@dataclass
class Reference:
    """The fp16 cache's distributions and held bytes (:func:`held_bytes`) on the evaluation
    samples; its perplexity over the continuations' ``scored`` tokens and the standard error
    of its mean token loss there (nats)."""

    logprobs: list[np.ndarray]
    cache_bytes: int
    tokens: int
    ppl: float = float("nan")
    nll_se: float = float("nan")
    scored: int = 0


@dataclass
class Row:
    """One spec's results (the fields of ``velox bench --json``). ``cache_bytes``: the
    :func:`held_bytes` of its caches after the first sample (``bytes_per_token`` per token
    held, ``compression_ratio`` fp16's held bytes over these, on the same tokens);
    ``resident_bytes``: their ``nbytes``, the buffers' unused capacity included."""

    spec: str
    method: str
    params: dict[str, Any]
    context: int
    cache_bytes: int = 0
    bytes_per_token: float = 0.0
    compression_ratio: float = 0.0
    resident_bytes: int = 0
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


def _run_sample(
    model, caches, prefix, cont, chunk, tokenizer=None
) -> tuple[np.ndarray, float, float, int]:
    mx.clear_cache()
    mx.reset_peak_memory()
    t0 = time.perf_counter()
    with routed(model):
        logits = prefill(model, caches, prefix, chunk)
        after_prefill(model, tokenizer, caches, prefix)  # counted in the prefill's time
        t1 = time.perf_counter()
        peak = int(mx.get_peak_memory())
        lp = teacher_force(model, caches, logits, cont)
    t2 = time.perf_counter()
    return lp, t1 - t0, t2 - t1, peak


def reference_run(
    model, make_caches: Callable[[], list], samples, chunk: int = 512, row: Row | None = None
) -> Reference:
    """The fp16 run every other spec is compared with.

    ``row``, when given, is filled from this same run as :func:`decode_quality` would fill it
    (KL 0 and top-1 1 by construction; perplexity, bytes, memory and speeds measured), so the
    fp16 spec does not run the samples a second time.
    """
    ref = Reference([], 0, 0)
    tally = None
    losses = []
    for i, (prefix, cont) in enumerate(samples):
        caches = make_caches()
        lp, tp, td, peak = _run_sample(model, caches, prefix, cont, chunk)
        ref.logprobs.append(lp)
        losses.extend((-lp[np.arange(len(cont)), np.asarray(cont)]).tolist())
        if i == 0:
            ref.cache_bytes = int(sum(held_bytes(c) for c in caches))
            ref.tokens = int(caches[0].offset)
            if row is not None:
                tally = Tally(row, ref)
                tally.first(caches, peak)
        if tally is not None:
            tally.add(i, lp, prefix, cont, tp, td)
        del caches
    if tally is not None:
        tally.finish()
    ref.scored = len(losses)
    if losses:
        ref.ppl = math.exp(float(np.mean(losses)))
    if len(losses) > 1:
        ref.nll_se = float(np.std(losses, ddof=1) / math.sqrt(len(losses)))
    return ref


class Tally:
    """Quality and speed of one spec over samples, against the fp16 reference: KL, top-1,
    perplexity and non-finite steps from each sample's log-probs, prefill and decode speed
    from its times; the first sample's caches give bytes, tokens and memory."""

    def __init__(self, row: Row, ref: Reference):
        self.row, self.ref = row, ref
        self.kls: list[float] = []
        self.agree = self.steps = self.pre_n = self.dec_n = 0
        self.nll = self.pre_t = self.dec_t = 0.0

    def first(self, caches: list, prefill_peak: int) -> None:
        r = self.row
        r.prefill_peak_memory = prefill_peak
        r.cache_bytes = int(sum(held_bytes(c) for c in caches))
        r.resident_bytes = int(sum(c.nbytes for c in caches))
        r.tokens = int(caches[0].offset)
        r.active_memory = int(mx.get_active_memory())
        r.nonfinite_layers = nonfinite_layers(caches)

    def add(self, i: int, lp: np.ndarray, prefix, cont, prefill_s: float, decode_s: float):
        ref = self.ref.logprobs[i]
        self.row.nonfinite_steps += int(np.sum(~np.all(np.isfinite(lp), axis=-1)))
        self.pre_t, self.pre_n = self.pre_t + prefill_s, self.pre_n + len(prefix)
        self.dec_t, self.dec_n = self.dec_t + decode_s, self.dec_n + len(cont) - 1
        self.kls.extend(kl_rows(ref, lp).tolist())
        self.agree += int(np.sum(np.argmax(lp, -1) == np.argmax(ref, -1)))
        self.nll -= float(np.sum(lp[np.arange(len(cont)), np.asarray(cont)]))
        self.steps += len(cont)

    def finish(self) -> None:
        r = self.row
        r.kl = float(np.mean(self.kls))
        r.top1 = self.agree / self.steps
        r.ppl = math.exp(self.nll / self.steps)
        r.prefill_tps = self.pre_n / self.pre_t if self.pre_t else 0.0
        r.decode_tps = self.dec_n / self.dec_t if self.dec_t else 0.0
        r.bytes_per_token = r.cache_bytes / max(r.tokens, 1)
        if r.tokens == self.ref.tokens and r.cache_bytes:
            r.compression_ratio = self.ref.cache_bytes / r.cache_bytes


def decode_quality(
    model,
    make_caches: Callable[[], list],
    samples,
    ref: Reference,
    row: Row,
    chunk: int = 512,
    tokenizer=None,
) -> None:
    """Fill ``row`` with KL, top-1, perplexity, bytes and speed over ``samples`` (the
    ``tokenizer`` goes to a method's step after the prefill, :func:`after_prefill`)."""
    tally = Tally(row, ref)
    for i, (prefix, cont) in enumerate(samples):
        caches = make_caches()
        lp, tp, td, peak = _run_sample(model, caches, prefix, cont, chunk, tokenizer)
        if i == 0:
            tally.first(caches, peak)
        tally.add(i, lp, prefix, cont, tp, td)
        del caches
    tally.finish()


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


def greedy(model, caches: list, logits: mx.array, n: int) -> list[int]:
    """``n`` greedy tokens, the first from ``logits``, each fed back (run inside ``routed``).

    Shapes: logits ``(1, V)``.
    """
    out = []
    for _ in range(n):
        y = mx.argmax(logits, axis=-1)
        out.append(int(y.item()))
        logits = model(y[:, None], cache=caches)[:, -1]
    return out


def recall_accuracy(
    prompts: list[RecallPrompt], tokenizer, answer: Callable[[RecallPrompt], list[int]]
) -> tuple[float, dict[str, float]]:
    """Exact-match accuracy of ``answer(prompt)`` (token ids) over recall prompts, overall and
    per prompt length."""
    hits: dict[int, list[bool]] = {}
    for p in prompts:
        hits.setdefault(p.length, []).append(p.correct(tokenizer.decode(answer(p))))
    flat = [h for v in hits.values() for h in v]
    return (
        sum(flat) / len(flat) if flat else float("nan"),
        {str(k): sum(v) / len(v) for k, v in sorted(hits.items())},
    )


def retrieval(
    model, tokenizer, make_caches: Callable[[], list], prompts: list[RecallPrompt], chunk: int = 512
) -> tuple[float, dict[str, float]]:
    """Exact-match accuracy of greedy answers to recall prompts (overall and per length)."""

    def answer(p: RecallPrompt) -> list[int]:
        caches = make_caches()
        with routed(model):
            logits = prefill(model, caches, p.tokens, chunk)
            after_prefill(model, tokenizer, caches, p.tokens)
            return greedy(model, caches, logits, p.answer_tokens)

    return recall_accuracy(prompts, tokenizer, answer)


def rows_from_json(path: str) -> tuple[list[Row], dict]:
    """Rows and run info from a ``velox bench --json`` file."""
    import json
    from pathlib import Path

    doc = json.loads(Path(path).read_text())
    items = doc["rows"] if isinstance(doc, dict) else doc
    info = doc["info"] if isinstance(doc, dict) else (items[0].get("run", {}) if items else {})
    rows = []
    for r in items:
        r = {k: v for k, v in r.items() if k != "run"}
        r = {
            k: (float("nan") if v is None and k in ("kl", "top1", "ppl", "retrieval") else v)
            for k, v in r.items()
        }
        rows.append(Row(**r))
    return rows, info
