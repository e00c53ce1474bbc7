"""Tables, JSON and charts of the long-context suite (``velox eval``)."""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rich.table import Table

from .run import Cell, Trial, aggregate

__all__ = [
    "append_trials",
    "chart",
    "columns",
    "load_json",
    "markdown",
    "summary",
    "table",
    "write_json",
]


def columns(cells: Sequence[Cell]) -> list[tuple[str, int]]:
    """The (task, length) pairs of the cells, in the order they appear."""
    return list(dict.fromkeys((c.task, c.length) for c in cells))


def summary(cells: Sequence[Cell]) -> list[dict[str, Any]]:
    """One row per spec: bytes, ratio, accuracy per (task, length), their mean, prompts and
    errors, KL and top-1 over the answer tokens, and its difference from fp16 on the prompts
    both finished. A run stopped by its time limit, or split by specs across workers, finishes
    different prompts for different specs: each spec's ``delta`` (the mean over its cells of
    its accuracy minus fp16's on the same (task, length, prompt)), paired interval
    ``delta_half`` and ``worst_delta`` (the lowest cell's) count those prompts alone, never
    fp16's whole cell. ``paired`` is how many prompts they pair, ``pairs`` the count per cell."""
    by_spec: dict[str, list[Cell]] = {}
    for c in cells:
        by_spec.setdefault(c.spec, []).append(c)
    rows = []
    for spec, cs in by_spec.items():
        ok = [c for c in cs if c.prompts]
        both = [c for c in ok if c.paired]  # cells with prompts fp16 finished too
        rows.append(
            {
                "spec": spec,
                "ratio": _mean([c.ratio for c in ok]),
                "layers_ratio": _mean([c.layers_ratio for c in ok]),
                "bytes_per_token": _mean([c.bytes_per_token for c in ok]),
                "accuracy": {f"{c.task}@{c.length}": c.accuracy for c in cs},
                "mean": _mean([c.accuracy for c in ok]),
                "delta": _mean([c.paired_delta for c in both]),
                "delta_half": paired_half(both),
                "worst_delta": min((c.paired_delta for c in both), default=float("nan")),
                "paired": sum(c.paired for c in cs),
                "pairs": [c.paired for c in cs],
                "kl": _mean([c.kl for c in ok]),
                "top1": _mean([c.top1 for c in ok]),
                "prompts": sum(c.prompts for c in cs),
                "errors": sum(c.errors for c in cs),
                "error": next((c.error for c in cs if c.error), None),
            }
        )
    return rows


def paired_half(cells: Sequence[Cell], z: float = 1.96) -> float:
    """The half-width of the 95% interval of a spec's mean difference from fp16 over
    ``cells`` (the mean of the cells' paired differences), from each cell's spread of
    per-prompt differences on the same prompts: much narrower than two separate intervals
    where the two sides answer most prompts alike. nan where a cell has under two pairs."""
    parts = [c.paired_sd**2 / c.paired for c in cells if c.paired > 1]
    if not cells or len(parts) < len(cells) or not all(math.isfinite(v) for v in parts):
        return float("nan")
    return z * math.sqrt(sum(parts)) / len(cells)


def _mean(xs) -> float:
    xs = [x for x in xs if isinstance(x, (int, float)) and math.isfinite(x)]
    return sum(xs) / len(xs) if xs else float("nan")


def _f(x: float, fmt: str = "{:.2f}") -> str:
    return "-" if not isinstance(x, (int, float)) or not math.isfinite(x) else fmt.format(x)


def _span(ns: Sequence[int]) -> str:
    """``48`` where every count is 48, ``40-48`` where they range."""
    lo, hi = min(ns, default=0), max(ns, default=0)
    return str(lo) if lo == hi else f"{lo}-{hi}"


def _note(cells: Sequence[Cell]) -> str:
    n = min((c.prompts for c in cells if c.prompts), default=0)
    widest = max(((c.high - c.low) / 2 for c in cells if c.prompts), default=float("nan"))
    layers = (
        " layers: the same over the layers the spec compresses (the model's own "
        "sliding-window caches, alike on both sides, left out)."
        if _has_layers(cells)
        else ""
    )
    return (
        f"accuracy: the share of expected answers found (RULER's string match), {n}+ prompts "
        f"per cell; the widest 95% interval (Wilson) is +-{_f(widest * 100, '{:.0f}')} "
        "points. vs fp16: fp16's held bytes over the spec's on the same prompts (the whole "
        f"model's caches).{layers} delta: mean accuracy minus fp16's on the prompts both "
        "finished, +- its paired 95% interval; worst: the lowest per-cell difference; "
        "pairs: the prompts a cell pairs (the fewest-most over the cells). KL / top-1: over "
        "the fp16 answer's tokens, teacher-forced."
    )


def _has_layers(cells: Sequence[Cell]) -> bool:
    """Whether any cell's model keeps sliding-window layers of its own (a second ratio)."""
    return any(math.isfinite(c.layers_ratio) for c in cells)


def _head(cells: Sequence[Cell], sep: str) -> list[str]:
    """The columns after the spec."""
    ratios = ["vs fp16", "layers"] if _has_layers(cells) else ["vs fp16"]
    return [*ratios, "B/token", *[f"{t}{sep}@{n}" for t, n in columns(cells)], *_STATS]


_STATS = ("mean", "delta", "+-", "worst", "pairs", "KL", "top-1")


def _rows(cells: Sequence[Cell]) -> list[tuple[dict[str, Any], list[str]]]:
    """Each spec's summary row and its formatted cells after the spec: vs fp16, B/token,
    accuracy per (task, length), then :data:`_STATS`."""
    cols = columns(cells)
    layers = _has_layers(cells)
    out = []
    for r in summary(cells):
        out.append(
            (
                r,
                [
                    _f(r["ratio"], "{:.2f}x"),
                    *([_f(r["layers_ratio"], "{:.2f}x")] if layers else []),
                    _f(r["bytes_per_token"], "{:,.0f}"),
                    *[_f(r["accuracy"].get(f"{t}@{n}", math.nan)) for t, n in cols],
                    _f(r["mean"]),
                    _f(r["delta"], "{:+.2f}"),
                    _f(r["delta_half"], "{:.2f}"),
                    _f(r["worst_delta"], "{:+.2f}"),
                    _span(r["pairs"]),
                    _f(r["kl"], "{:.3f}"),
                    _f(r["top1"]),
                ],
            )
        )
    return out


def _cut(info: dict) -> str:
    """When the run's retention policies cut (``--cut``); a run recorded before the setting
    existed names none."""
    return f", cut {info['cut']}" if info.get("cut") else ""


def table(cells: Sequence[Cell], info: dict) -> Table:
    t = Table(
        title=f"velox eval: {Path(str(info.get('model', ''))).name} | question "
        f"{info.get('question')}{_cut(info)} | haystack {info.get('haystack')}",
        caption=_note(cells),
    )
    t.add_column("spec", no_wrap=True)
    for name in _head(cells, "\n"):
        t.add_column(name, justify="right")
    rows = _rows(cells)
    notes = _error_notes(rows)
    for r, row in rows:
        errors = f" ({r['errors']} errors [{notes[r['error']]}])" if r["errors"] else ""
        t.add_row(r["spec"] + errors, *row)
    if notes:
        t.caption = (t.caption or "") + "".join(f"\n[{k}] {e}" for e, k in notes.items())
    return t


def _error_notes(rows: list[tuple[dict[str, Any], list[str]]]) -> dict[str, int]:
    """Each distinct first error of the rows, numbered from 1 (the table's footnotes: a
    long message in the spec column would squeeze every other column out)."""
    notes: dict[str, int] = {}
    for r, _ in rows:
        if r["errors"] and r["error"] not in notes:
            notes[r["error"]] = len(notes) + 1
    return notes


def markdown(cells: Sequence[Cell]) -> str:
    head = ["spec", *_head(cells, " ")]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    rows = _rows(cells)
    notes = _error_notes(rows)
    for r, row in rows:
        errors = f" ({r['errors']} errors [{notes[r['error']]}])" if r["errors"] else ""
        lines.append("| " + " | ".join([f"`{r['spec']}`{errors}", *row]) + " |")
    foot = "".join(f"\n[{k}] {e}\n" for e, k in notes.items())
    return "\n".join(lines) + "\n\n" + _note(cells) + "\n" + foot


def write_json(path: str, trials: Sequence[Trial], info: dict) -> None:
    """``{"run": settings, "cells": [...], "trials": [...]}``: every prompt's answer kept."""
    out = {
        "run": info,
        "cells": [c.to_json() for c in aggregate(list(trials))],
        "trials": [_clean(vars(t)) for t in trials],
    }
    Path(path).write_text(json.dumps(out, indent=1) + "\n")


def append_trials(path: str, trials: Sequence[Trial]) -> None:
    """Append trials to a JSON-lines file, one per line (a run's record as it goes)."""
    with open(path, "a") as f:
        for t in trials:
            f.write(json.dumps(_clean(vars(t))) + "\n")


def _clean(d: dict) -> dict:
    return {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in d.items()}


def load_json(path: str) -> tuple[list[Trial], dict]:
    """A run's trials and settings from ``write_json``'s file, or trials alone from the
    JSON-lines record of a run that did not finish (``velox eval --json PATH`` keeps it
    beside the JSON as ``PATH.trials.jsonl``)."""
    text = Path(path).read_text()
    if path.endswith(".jsonl"):
        data = {"trials": [json.loads(line) for line in text.splitlines() if line.strip()]}
        data["run"] = {"model": "", "question": "?", "haystack": "?", "partial": True}
    else:
        data = json.loads(text)
    trials = []
    for d in data["trials"]:
        d = {
            k: (float("nan") if v is None and k in ("score", "kl", "top1") else v)
            for k, v in d.items()
        }
        trials.append(Trial(**d))
    return trials, data["run"]


def chart(path: str, cells: Sequence[Cell], info: dict) -> None:
    """Mean accuracy over the tasks against held bytes per token, one panel per length, one
    line per method family (its specs by bytes), the baselines marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from ..chart import family

    lengths = sorted({c.length for c in cells})
    fig, axes = plt.subplots(
        1, len(lengths), figsize=(6.5 * len(lengths), 5.2), squeeze=False, sharey=True
    )
    for ax, length in zip(axes[0], lengths):
        rows = summary([c for c in cells if c.length == length])
        fams: dict[str, list[dict]] = {}
        for r in rows:
            if math.isfinite(r["mean"]) and math.isfinite(r["bytes_per_token"]):
                name = r["spec"].split(":", 1)[0] if "+" not in r["spec"] else "composition"
                fams.setdefault(name, []).append(r)
        for name, rs in sorted(fams.items()):
            rs.sort(key=lambda r: r["bytes_per_token"])
            xs = [r["bytes_per_token"] for r in rs]
            ys = [r["mean"] for r in rs]
            if name == "fp16" or name.startswith("mlx-q"):
                for r in rs:
                    ax.scatter(
                        [r["bytes_per_token"]],
                        [r["mean"]],
                        marker="*",
                        s=160,
                        zorder=5,
                        color="black" if name == "fp16" else "grey",
                        label=r["spec"],
                    )
                continue
            ax.plot(xs, ys, marker="o", label=f"{name} ({family(name)})")
            for r in rs:
                ax.annotate(
                    r["spec"].split(":", 1)[-1][:24],
                    (r["bytes_per_token"], r["mean"]),
                    fontsize=6,
                    xytext=(3, 3),
                    textcoords="offset points",
                )
        ax.set_xscale("log")
        ax.set_xlabel("held bytes per token (log)")
        ax.set_title(f"{length:,} tokens")
        ax.grid(True, alpha=0.3)
    axes[0][0].set_ylabel("mean accuracy over tasks")
    axes[0][0].set_ylim(-0.03, 1.03)
    handles, labels = axes[0][-1].get_legend_handles_labels()
    fig.legend(handles, labels, loc="center right", fontsize=7)
    model = Path(str(info.get("model", ""))).name
    fig.suptitle(
        f"velox eval: {model}, tasks {', '.join(info.get('tasks', []))}, question "
        f"{info.get('question')}{_cut(info)}"
    )
    fig.tight_layout(rect=(0, 0, 0.8, 0.95))
    fig.savefig(path, dpi=120)
    plt.close(fig)
