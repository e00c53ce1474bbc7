"""The long-context suite's cells: one spec on one task at one length, aggregated from the
trials (accuracy with Wilson's 95% interval, KL and top-1 against fp16, bytes and the ratio
to fp16's). Public through :mod:`velox_cli.longctx.run`."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

__all__: list[str] = []


@dataclass
class Cell:
    """One spec on one task at one length: accuracy with its 95% interval, the share of
    fully correct answers, KL and top-1 over the answer tokens against fp16, bytes."""

    spec: str
    task: str
    length: int
    prompts: int
    accuracy: float
    low: float
    high: float
    exact: float
    kl: float
    top1: float
    bytes: float
    bytes_per_token: float
    ratio: float  # fp16's held bytes / this spec's, on the same prompts
    # the same over the layers the spec compresses: the model's own sliding-window caches
    # (Gemma 3's local layers, the same bytes on both sides) left out; nan where there are none
    layers_ratio: float
    tokens: float
    seconds: float
    errors: int = 0
    error: str | None = None
    # paired with fp16 on the same prompts: the mean of (score - fp16's score) and the sample
    # deviation of those differences, over the prompts both answered
    paired: int = 0
    paired_delta: float = float("nan")
    paired_sd: float = float("nan")

    def to_json(self) -> dict[str, Any]:
        return {
            k: (None if isinstance(v, float) and not math.isfinite(v) else v)
            for k, v in asdict(self).items()
        }


def wilson(p: float, n: int, z: float = 1.96) -> tuple[float, float]:
    """Wilson's 95% score interval for a share ``p`` of ``n`` trials."""
    if n == 0 or not math.isfinite(p):
        return float("nan"), float("nan")
    d = 1 + z * z / n
    mid = (p + z * z / (2 * n)) / d
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / d
    return max(0.0, mid - half), min(1.0, mid + half)


@dataclass
class Trial:
    """One spec on one prompt."""

    spec: str
    task: str
    length: int
    index: int
    depth: float
    tokens: int
    score: float = float("nan")
    output: str = ""
    kl: float = float("nan")
    top1: float = float("nan")
    bytes: int = 0
    window_bytes: int = 0  # of :data:`bytes`, held by the model's own sliding-window caches
    seconds: float = 0.0
    error: str | None = None


def aggregate(trials: list[Trial]) -> list[Cell]:
    """Cells (spec, task, length) from trials, in the order specs first appear."""
    groups: dict[tuple[str, str, int], list[Trial]] = {}
    for t in trials:
        groups.setdefault((t.spec, t.task, t.length), []).append(t)
    fp16 = {(k[1], k[2], t.index): t for k, ts in groups.items() if k[0] == "fp16" for t in ts}
    ref = {k: t.bytes for k, t in fp16.items()}
    cells = []
    for (spec, task, length), ts in groups.items():
        ok = [t for t in ts if t.error is None]
        errors = len(ts) - len(ok)
        diffs = [
            t.score - r.score
            for t in ok
            if (r := fp16.get((task, length, t.index))) is not None and r.error is None
        ]
        acc = float(np.mean([t.score for t in ok])) if ok else float("nan")
        lo, hi = wilson(acc, len(ok))
        ratios = [
            ref[(task, length, t.index)] / t.bytes
            for t in ok
            if t.bytes and (task, length, t.index) in ref  # a stopped run may lack fp16's
        ]
        layers = [
            (r.bytes - r.window_bytes) / (t.bytes - t.window_bytes)
            for t in ok
            if (r := fp16.get((task, length, t.index))) is not None
            and r.window_bytes
            and t.bytes > t.window_bytes
        ]
        cells.append(
            Cell(
                spec,
                task,
                length,
                len(ok),
                acc,
                lo,
                hi,
                float(np.mean([t.score == 1.0 for t in ok])) if ok else float("nan"),
                float(np.mean([t.kl for t in ok])) if ok else float("nan"),
                float(np.mean([t.top1 for t in ok])) if ok else float("nan"),
                float(np.mean([t.bytes for t in ok])) if ok else float("nan"),
                float(np.mean([t.bytes / t.tokens for t in ok])) if ok else float("nan"),
                float(np.mean(ratios)) if ratios else float("nan"),
                float(np.mean(layers)) if layers else float("nan"),
                float(np.mean([t.tokens for t in ts])),
                float(np.sum([t.seconds for t in ts])),
                errors,
                next((t.error for t in ts if t.error), None),
                len(diffs),
                float(np.mean(diffs)) if diffs else float("nan"),
                float(np.std(diffs, ddof=1)) if len(diffs) > 1 else float("nan"),
            )
        )
    return cells
