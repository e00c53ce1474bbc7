"""Measuring a mapper: the target's decode from a transferred cache against its own prefill.

For each prefix length ``P`` and sample (a window of the evaluation stream), the reference
is the target model's own prefill of the ``P`` prefix tokens into mlx-lm ``KVCache``, then a
teacher-forced continuation of ``continuation`` tokens. Each other way of reaching the same
continuation gets the target's next-token distributions on the same tokens, compared by
mean ``KL(p_ref || p)`` and top-1 agreement:

* ``transfer``: the source model's cache of the first ``P - 1`` tokens mapped, then the
  target runs the last prefix token (it needs that token's logits);
* ``transfer + last N``: the first ``P - N`` tokens mapped, the last ``N`` prefilled by the
  target on top;
* ``empty cache``: the target sees only the last prefix token;
* ``last N only``: the target prefills only the last ``N`` prefix tokens (from position 0).

``seconds`` is the wall time from nothing (or from the source's cache, for the transfers) to
the target's first logits, median over samples; the reference's is its full prefill, so the
difference is the prefill time a transfer saves. The source's own prefill is not counted:
in the use it serves, the source has already run it.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass
from typing import Any

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import KVCache

from velox_core import routed

from .apply import transfer_cache
from .mapper import Mapper

__all__ = ["Row", "evaluate", "format_table"]

CHUNK = 512


@dataclass
class Row:
    """One way of reaching the continuation at one prefix length."""

    prefix: int
    way: str
    target_prefill: int  # prefix tokens the target model ran itself
    kl: float
    top1: float
    seconds: float

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def _feed(model, caches, tokens: np.ndarray) -> mx.array:
    """Prefill ``tokens`` in chunks; the last position's logits."""
    ids = mx.array(np.asarray(tokens, dtype=np.int32))[None]
    logits = None
    for s in range(0, ids.shape[1], CHUNK):
        logits = model(ids[:, s : s + CHUNK], cache=caches)[:, -1]
        mx.eval(logits)
    return logits


def _force(model, caches, logits: mx.array, cont: np.ndarray) -> np.ndarray:
    """Log-probabilities predicting each continuation token, ``(len(cont), vocab)``."""
    rows = []
    for i, t in enumerate(cont):
        lf = logits.astype(mx.float32)
        rows.append(lf - mx.logsumexp(lf, axis=-1, keepdims=True))
        if i + 1 < len(cont):
            logits = model(mx.array([[int(t)]]), cache=caches)[:, -1]
        mx.eval(rows[-1], logits)
    return np.concatenate([np.asarray(r) for r in rows], axis=0)


def _compare(ref: np.ndarray, lp: np.ndarray) -> tuple[float, float]:
    p = np.exp(ref)
    kl = float(np.mean(np.sum(p * (ref - lp), axis=-1)))
    top1 = float(np.mean(ref.argmax(-1) == lp.argmax(-1)))
    return kl, top1


def _fresh(n: int) -> list:
    return [KVCache() for _ in range(n)]


def evaluate(
    source: Any,
    target: Any,
    mapper: Mapper,
    stream: np.ndarray,
    prefixes: tuple[int, ...] = (256, 1024, 2048),
    *,
    continuation: int = 32,
    samples: int = 4,
    tails: tuple[int, ...] = (16, 64, 256),
    cache: Any = "fp16",
) -> list[Row]:
    """The rows described in this module's docstring, for every prefix length.

    Args:
        stream: evaluation tokens (disjoint from the mapper's calibration).
        cache: the transferred caches' format (see :func:`velox_transfer.transfer_cache`).
    """
    mapper.check_models(source, target)
    if continuation < 1 or samples < 1:
        raise ValueError("continuation and samples must be at least 1")
    n_src, n_tgt = len(mapper.source.layers), len(mapper.target.layers)
    acc: dict[tuple[int, str, int], list] = {}  # (prefix, way, prefilled) -> per sample

    def add(p: int, way: str, prefilled: int, lp: np.ndarray, sec: float, ref: np.ndarray):
        acc.setdefault((p, way, prefilled), []).append((*_compare(ref, lp), sec))

    for p in prefixes:
        span = p + continuation
        if p < 2 or span > len(stream):
            raise ValueError(
                f"prefix {p}: needs 2 <= prefix and prefix + continuation <= "
                f"{len(stream)} evaluation tokens"
            )
        tails_p = [n for n in tails if 1 < n < p]
        starts = np.linspace(0, len(stream) - span, samples).astype(int)
        for s0 in starts:
            seq = stream[s0 : s0 + span]
            pre, cont = seq[:p], seq[p:]
            with routed(target):
                t0 = time.perf_counter()
                c = _fresh(n_tgt)
                logits = _feed(target, c, pre)
                sec = time.perf_counter() - t0
                ref = _force(target, c, logits, cont)
                add(p, "target prefill", p, ref, sec, ref)
                src = _fresh(n_src)
                _feed(source, src, pre)
                for n in [1, *tails_p]:
                    t0 = time.perf_counter()
                    c = transfer_cache(src, mapper, cache, model=target, tokens=p - n)
                    logits = _feed(target, c, pre[p - n :])
                    sec = time.perf_counter() - t0
                    way = "transfer" if n == 1 else f"transfer + last {n}"
                    add(p, way, n, _force(target, c, logits, cont), sec, ref)
                for n in [1, *tails_p]:
                    t0 = time.perf_counter()
                    c = _fresh(n_tgt)
                    logits = _feed(target, c, pre[p - n :])
                    sec = time.perf_counter() - t0
                    way = "empty cache" if n == 1 else f"last {n} only"
                    add(p, way, n, _force(target, c, logits, cont), sec, ref)
    rows = []
    for (p, way, prefilled), vals in acc.items():
        kl, top1, sec = zip(*vals)
        rows.append(
            Row(
                p,
                way,
                prefilled,
                float(np.mean(kl)),
                float(np.mean(top1)),
                float(statistics.median(sec)),
            )
        )
    return rows


def format_table(rows: list[Row]) -> str:
    """A Markdown table of ``rows``."""
    out = [
        "| prefix | way | target prefill tokens | KL | top-1 | seconds to first logits |",
        "|---:|:---|---:|---:|---:|---:|",
    ]
    for r in rows:
        out.append(
            f"| {r.prefix} | {r.way} | {r.target_prefill} | {r.kl:.4f} | {r.top1:.3f} | "
            f"{r.seconds:.3f} |"
        )
    return "\n".join(out)
