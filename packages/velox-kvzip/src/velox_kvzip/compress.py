"""``compress``: KVzip's reconstruction step, run once after the prefill (arXiv 2505.23416).

KVzip needs the model to score the cache, so a velox user runs one step between the
prefill of the context and the queries that reuse it::

    caches = velox_core.make_cache(model, "kvzip:budget=25%")
    with velox_core.routed(model):
        model(mx.array([context]), cache=caches)  # the prefill, in any chunks
        velox_kvzip.compress(model, caches, context, tokenizer)
        # any question, any number of times (copy.deepcopy(caches) for each)

``velox eval``, ``velox generate`` and ``velox bench`` run it after their prefill.

What it does. The context (``tokens``, from ``start``) is cut into chunks of ``chunk`` tokens.
For each chunk the model runs, over the caches, the reconstruction input: ``prompt`` (later
chunks ``prompt_next`` and the previous chunk's last ``overlap`` tokens), ``suffix``, then
the chunk's tokens teacher-forced, in pieces of ``step`` tokens as a prefill goes in chunks
(attention is causal: the same scores as one piece). Attention is routed to the caches, so
each KVzip layer's policy sees the queries and scores the chunk's pairs
(:func:`~velox_kvzip.score.chunk_scores`); the model's own attention runs over every stored
token, as it would in the paper. The
reconstruction tokens are then trimmed from every cache, so offsets, positions and the next
token's RoPE are the prefill's. After the last chunk each layer keeps its budget
(:func:`~velox_kvzip.select.keep_sets`) and the rest leave memory.

Cost. The reconstruction runs ``n + chunks x (instruction tokens)`` tokens through the model:
the projections and MLPs of one more prefill, and attention over the whole context for every
query (a prefill's query sees ``n / 2`` keys on average). The scores add one ``QK^T`` per
query over ``sinks + chunk + reconstruction`` keys, in blocks of at most ``SCORE_ELEMENTS``
weights. A model whose compute is mostly attention (short hidden size, long context) pays
several prefills (docs/kvzip.md measures it). Memory: the caches hold the context plus one
chunk's reconstruction tokens; the transient memory is that of a ``step``-token prefill
chunk.

Deviations from the paper (also in docs/kvzip.md):

* Scores are float32 (the authors' in the model's dtype) and come from the stored keys (their
  codes when ``bits`` is set).
* Tokens before ``start`` (a system prompt or template) are kept, as the authors keep their
  system prompt; kvpress leaves its template prefix unscored, so evicted first.
* Only ``every=None``: decode tokens are never evicted (the paper's setting).
* A batch needs ``heads="uniform"`` (the others store each head's own count: batch 1, as the
  authors' and kvpress's implementations).
"""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
import numpy as np

from velox_core import RetentionPolicy, routed
from velox_core.validation import check_int

from .select import keep_sets

__all__ = ["STEP", "Compression", "compress"]

# reconstruction tokens run through the model at once, by default (velox bench's prefill chunk)
STEP = 512


@dataclass
class Compression:
    """What :func:`compress` did: context tokens scored, chunks, reconstruction tokens run
    through the model, tokens kept per KV head (mean, per KVzip layer), wall time, and each
    KVzip layer's scores: float32 ``(B, H, n)`` by position (``inf`` before ``start``)."""

    context: int
    chunks: int
    repeated: int
    kept: list[float]
    seconds: float
    scores: list[mx.array] = field(repr=False)


def compress(
    model, caches: list, tokens, tokenizer, *, start: int = 0, step: int = STEP
) -> Compression:
    """Score the prefilled context by reconstruction and cut every KVzip cache to its budget.

    Args:
        model: the mlx-lm model the caches were prefilled with.
        caches: one cache per layer (``velox_core.make_cache``), holding ``tokens`` exactly.
            Other layers' caches see the reconstruction too: each is trimmed back after a
            chunk, or, where it cannot be (``is_trimmable()`` False: mlx-lm's
            ``RotatingKVCache`` past its window, Gemma 3's sliding layers), copied before
            the first chunk and restored after each.
        tokens: the token ids the caches hold: ``(n,)`` or ``(B, n)`` ints.
        tokenizer: encodes the repeat instruction (``tokenizer.encode(text,
            add_special_tokens=False)``).
        start: tokens ``[0, start)`` are kept and not reconstructed (a system prompt).
        step: reconstruction tokens run through the model at once (a chunk's input goes in
            pieces of ``step``, as a prefill goes in chunks: the same scores, attention being
            causal, and the transient memory of a ``step``-token prefill chunk).
    """
    t0 = time.perf_counter()
    zipped = [(c, c.policy) for c in caches if _is_kvzip(getattr(c, "policy", None))]
    if not zipped:
        raise ValueError("kvzip: compress found no kvzip cache among the caches")
    policy = zipped[0][1]
    for _, p in zipped[1:]:
        for name in policy.settings:
            if getattr(p, name) != getattr(policy, name):
                raise ValueError(f"kvzip: the layers' {name} settings differ; compress needs one")
    ids = np.asarray(tokens)
    ids = ids[None] if ids.ndim == 1 else ids
    if ids.ndim != 2 or ids.shape[1] == 0 or not np.issubdtype(ids.dtype, np.integer):
        raise ValueError(f"kvzip: tokens must be (n,) or (B, n) token ids, got {ids.shape}")
    b, n = ids.shape
    check_int("start", start, minimum=0, maximum=n - 1)
    check_int("step", step, minimum=1)
    _check(caches, zipped, b, n, policy.heads)
    if tokenizer is None:
        raise ValueError("kvzip: compress needs the tokenizer (it encodes the repeat prompt)")
    pieces = _repeat_inputs(tokenizer, policy, ids, start)
    inner = getattr(model, "model", None)
    forward = inner if callable(inner) and hasattr(inner, "layers") else model
    parts: list[list[mx.array]] = [[] for _ in zipped]
    ours = {id(c) for c, _ in zipped}
    held = {
        i: copy.deepcopy(c)
        for i, c in enumerate(caches)
        if id(c) not in ours and not c.is_trimmable()
    }
    try:
        with routed(model):
            for s, e, x in pieces:
                for c, p in zipped:
                    p.begin(min(max(c.sinks, start), s), s, e, n)
                for i in range(0, x.shape[1], step):
                    h = forward(mx.array(x[:, i : i + step]), cache=caches)
                    got = [p.pending() for _, p in zipped]
                    if any(g is None for g in got):
                        raise ValueError(
                            "kvzip: a kvzip layer saw no reconstruction query: its attention "
                            "does not reach velox's (a layer with attention code of its own)"
                        )
                    mx.eval(h, got)
                got = [p.take() for _, p in zipped]
                for out, g in zip(parts, got):
                    out.append(g)
                _roll_back(caches, n, held, last=s == pieces[-1][0])
    finally:  # an error midway leaves the caches as the prefill left them
        _roll_back(caches, n, held, last=True)
        for _, p in zipped:
            p.take()
    full = [_full(got, start) for got in parts]
    kept = _cut(zipped, full, n, policy.heads)
    repeated = sum(x.shape[1] for *_, x in pieces)
    return Compression(n - start, len(pieces), repeated, kept, time.perf_counter() - t0, full)


def _roll_back(caches: list, n: int, held: dict[int, Any], last: bool) -> None:
    """Every cache back to the ``n`` prefilled tokens: trimmed, or (``held``: the copies of
    those that cannot be trimmed) restored from its copy (the copy itself after the last
    chunk, a fresh copy of it before another)."""
    for i, c in enumerate(caches):
        if i in held:
            c.__dict__.update((held[i] if last else copy.deepcopy(held[i])).__dict__)
        elif c.offset > n:
            c.trim(c.offset - n)


def _is_kvzip(policy) -> bool:
    """Whether a layer's retention policy is KVzip's (:class:`~velox_kvzip.KVzipPolicy`,
    known by its method name: the policy module imports this one for its hook)."""
    return getattr(type(policy), "name", None) == "kvzip" and hasattr(policy, "begin")


def _check(caches: list, zipped: list, b: int, n: int, heads: str) -> None:
    """Every cache holds the ``n`` tokens; KVzip caches uncut."""
    for i, c in enumerate(caches):
        if getattr(c, "offset", None) != n:
            raise ValueError(
                f"kvzip: layer {i}'s cache holds {getattr(c, 'offset', None)} tokens, "
                f"tokens gives {n}: compress right after prefilling exactly these tokens"
            )
    for c, p in zipped:
        if p.compressed or c.size() != n:
            raise ValueError("kvzip: the caches are compressed already (compress runs once)")
        if c.kv_heads is not None and c.stored.dims[0] != b:
            raise ValueError(f"kvzip: the caches hold {c.stored.dims[0]} rows, tokens {b}")
    if b > 1 and heads != "uniform":
        raise ValueError(
            f"kvzip: heads={heads!r} keeps a different count in each head (batch 1); a batch "
            f"of {b} needs heads='uniform'"
        )


def _repeat_inputs(tokenizer, p: RetentionPolicy, ids: np.ndarray, start: int) -> list:
    """``(start, end, input ids (B, L))`` of each chunk's reconstruction (``p`` a
    :class:`~velox_kvzip.KVzipPolicy`; this module does not import the policy, whose
    ``after_prefill`` hook imports it)."""

    def enc(text: str) -> np.ndarray:
        got = list(tokenizer.encode(text, add_special_tokens=False)) if text else []
        return np.broadcast_to(np.asarray(got, dtype=np.int64), (ids.shape[0], len(got)))

    first, later, suffix = enc(p.prompt), enc(p.prompt_next), enc(p.suffix)
    out = []
    for s in range(start, ids.shape[1], p.chunk):
        e = min(s + p.chunk, ids.shape[1])
        lead = [first] if s == start else [later, ids[:, s - min(p.overlap, p.chunk) : s]]
        x = np.concatenate([*lead, suffix, ids[:, s:e]], axis=1).astype(np.int32)
        out.append((s, e, x))
    return out


def _full(got: list[mx.array], start: int) -> mx.array:
    """One layer's chunk scores joined, ``(B, H, n)``: the tokens before ``start`` ``inf``."""
    full = mx.concatenate(got, axis=2)  # (B, H, n - start)
    if not start:
        return full
    pre = mx.full((*full.shape[:2], start), mx.inf, dtype=mx.float32)
    return mx.concatenate([pre, full], axis=2)


def _cut(zipped: list, scores_by_pos: list, n: int, heads: str) -> list[float]:
    """Each KVzip cache keeps its share of the body pairs, by score; returns the tokens each
    keeps per KV head (mean over heads)."""
    scores, quotas = [], []
    for (c, p), full in zip(zipped, scores_by_pos):
        pos = c.policy_view.body_positions()
        if any(q is None for q in pos):
            scores.append(mx.zeros((*full.shape[:2], 0), dtype=mx.float32))
        else:
            scores.append(mx.take_along_axis(full, mx.stack(pos, axis=1), axis=2))
        quotas.append(max(p.kept(n) - c.protected(), 0))
    keep = keep_sets(heads, scores, quotas)
    kept = []
    for (c, p), k in zip(zipped, keep):
        if k is not None:
            c.evict(k)
        p.done(p.kept(n))
        kept.append(c.protected() + float(np.mean(c.body_sizes())))
    return kept
