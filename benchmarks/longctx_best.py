"""Which methods keep their answers at long context: the best setting of each method at about
4x, 8x and 16x fewer bytes, gathered from ``velox eval`` runs.

Each run's JSON (``velox eval --json``) is read as ``velox eval --from-json`` reads it; a spec's
row is its accuracy difference from fp16 on the same prompts of that run (the paired 95%
interval), at its measured byte ratio. The ratio is the one over the layers a spec compresses
(``layers``: a model's own sliding-window caches left out) where the run has it, else the
whole model's. A spec run more than once with the question in the same place counts by its run
with the most prompts. Each method (a composition ``A+B`` counts as its own) keeps, at each
operating point, its setting with the highest difference (its lower bound breaks ties).
Operating points by ratio: 4x is [3, 6), 8x [6, 12), 16x [12, inf).

    python benchmarks/longctx_best.py docs/data/eval-h100-gemma3-*.json --markdown out.md

prints the table (spec, ratio, difference, interval, question placement and run for each
method and point) and, with ``--markdown``, writes it; ``--compact`` writes one cell a point
in points of accuracy, ``-3 (i)`` where the question was inside the compressed prompt.
``--readme README.md`` rewrites the column "Gemma 3: 4x / 8x" of README's methods table in
place from the same rows: each method's row gets its compact 4x and 8x cells, ``-`` where it
has neither.
"""

from __future__ import annotations

import argparse
import math
import sys
from dataclasses import dataclass
from pathlib import Path

from velox_cli.longctx import report
from velox_cli.longctx.cells import aggregate

POINTS = (("4x", 3.0, 6.0), ("8x", 6.0, 12.0), ("16x", 12.0, math.inf))
README_COLUMN = "Gemma 3: 4x / 8x"


@dataclass
class Entry:
    """One spec of one run: its method, ratio, mean difference from fp16 and interval."""

    method: str
    spec: str
    ratio: float
    delta: float
    half: float
    worst: float
    prompts: int
    question: str
    run: str

    @property
    def low(self) -> float:
        return self.delta - (self.half if math.isfinite(self.half) else 1.0)


def method_of(spec: str) -> str:
    """``snapkv:budget=25%,kernel=15+turboquant:bits=4`` -> ``snapkv+turboquant``."""
    return "+".join(part.split(":", 1)[0] for part in spec.split("+"))


def entries(path: str) -> list[Entry]:
    """The rows of one ``velox eval --json`` file, fp16's and errored ones left out. Each spec
    is compared with fp16 on the prompts both finished (:func:`velox_cli.longctx.report.summary`:
    a run stopped midway, or split by specs, finishes different prompts for different specs);
    its prompts are those it pairs."""
    trials, info = report.load_json(path)
    if not any(t.spec == "fp16" for t in trials):
        raise ValueError(f"{path}: no fp16 trials to compare against")
    out = []
    for row in report.summary(aggregate(trials)):
        if row["spec"] == "fp16" or row["errors"] or not math.isfinite(row["delta"]):
            continue
        ratio = row["layers_ratio"] if math.isfinite(row["layers_ratio"]) else row["ratio"]
        out.append(
            Entry(
                method_of(row["spec"]),
                row["spec"],
                ratio,
                row["delta"],
                row["delta_half"],
                row["worst_delta"],
                row["paired"],
                str(info.get("question", "?")),
                Path(path).name,
            )
        )
    return out


def point_of(ratio: float) -> str | None:
    for name, lo, hi in POINTS:
        if lo <= ratio < hi:
            return name
    return None


def best(rows: list[Entry]) -> dict[str, dict[str, Entry]]:
    """Per method, per point, the row with the highest difference (then lower bound, then
    prompts). A spec run more than once with the question in the same place counts once, by
    its run with the most prompts (not its best one: the runs draw the same seeded prompts)."""
    runs: dict[tuple[str, str], Entry] = {}
    for e in rows:
        have = runs.get((e.spec, e.question))
        if have is None or e.prompts > have.prompts:
            runs[(e.spec, e.question)] = e
    out: dict[str, dict[str, Entry]] = {}
    for e in runs.values():
        p = point_of(e.ratio)
        if p is None:
            continue
        have = out.setdefault(e.method, {}).get(p)
        key = (round(e.delta, 6), round(e.low, 6), e.prompts)
        if have is None or key > (round(have.delta, 6), round(have.low, 6), have.prompts):
            out[e.method][p] = e
    return out


def _cell(e: Entry | None) -> str:
    if e is None:
        return "-"
    half = f" +-{e.half:.2f}" if math.isfinite(e.half) else ""
    q = ", question inside" if e.question == "inside" else ""
    return f"`{e.spec}` {e.ratio:.1f}x: {e.delta:+.2f}{half} (worst {e.worst:+.2f}{q})"


def _compact(e: Entry | None) -> str:
    if e is None:
        return "-"
    return f"{round(100 * e.delta):+d}" + (" (i)" if e.question == "inside" else "")


def markdown(table: dict[str, dict[str, Entry]], compact: bool = False) -> str:
    names = [p[0] for p in POINTS]
    order = sorted(table, key=lambda m: (-max(e.delta for e in table[m].values()), m))
    lines = ["| method | " + " | ".join(names) + " |", "|---" * (len(names) + 1) + "|"]
    fmt = _compact if compact else _cell
    for m in order:
        lines.append(f"| {m} | " + " | ".join(fmt(table[m].get(p)) for p in names) + " |")
    return "\n".join(lines) + "\n"


def _cells(line: str) -> list[str]:
    """A Markdown table row's cells, stripped."""
    return [c.strip() for c in line.strip().strip("|").split("|")]


def readme_column(
    text: str, table: dict[str, dict[str, Entry]], column: str = README_COLUMN
) -> str:
    """``text`` (a README) with the column ``column`` of its table that has a ``method``
    column rewritten from ``table``: the row of each method (its name in backticks in the
    method cell) gets the compact cells of the points the column's name lists after its
    colon (``4x / 8x``), joined by `` / ``; ``-`` where the method has none of them. The
    table's other cells and lines are left as they are."""
    points = [p.strip() for p in column.rpartition(":")[2].split("/")]
    unknown = [p for p in points if p not in {name for name, _, _ in POINTS}]
    if ":" not in column or unknown:
        raise ValueError(
            f"column {column!r}: its name ends in a colon and points among "
            f"{', '.join(p[0] for p in POINTS)} joined by ' / ' (e.g. {README_COLUMN!r})"
        )
    lines = text.split("\n")
    head = next(
        (
            i
            for i, line in enumerate(lines)
            if line.startswith("|") and {"method", column} <= set(_cells(line))
        ),
        None,
    )
    if head is None:
        raise ValueError(f"no Markdown table with the columns 'method' and {column!r}")
    names = _cells(lines[head])
    if head + 1 == len(lines) or set(lines[head + 1].replace("|", "").strip()) - set("-: "):
        raise ValueError(f"line {head + 2}: the table's head is not followed by its |---| line")
    at, method = names.index(column), names.index("method")
    for i in range(head + 2, len(lines)):
        if not lines[i].startswith("|"):
            break
        cells = _cells(lines[i])
        if len(cells) != len(names):
            raise ValueError(
                f"line {i + 1}: {len(cells)} cells where the table's head has {len(names)}: "
                f"{lines[i][:80]!r}"
            )
        row = table.get(cells[method].strip("`"), {})
        got = [_compact(row.get(p)) for p in points]
        cells[at] = "-" if all(g == "-" for g in got) else " / ".join(got)
        lines[i] = "| " + " | ".join(cells) + " |"
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("runs", nargs="+", help="velox eval --json files")
    ap.add_argument("--markdown", metavar="PATH", help="also write the table as Markdown")
    ap.add_argument("--compact", action="store_true", help="one number a cell: points of accuracy")
    ap.add_argument(
        "--readme",
        metavar="PATH",
        help=f"rewrite the column {README_COLUMN!r} of PATH's methods table (README.md) in place",
    )
    ap.add_argument(
        "--drop",
        nargs="+",
        default=[],
        metavar="RUN:METHOD",
        help="leave out a method's rows of one run (the file's name), e.g. a run whose "
        "settings that method did not honour",
    )
    a = ap.parse_args(argv)
    drop = set()
    for d in a.drop:
        run, sep, method = d.rpartition(":")
        if not sep or not run or not method:
            ap.error(f"--drop takes RUN:METHOD (a run's file name and a method), got {d!r}")
        drop.add((run, method))
    rows = [e for path in a.runs for e in entries(path) if (e.run, e.method) not in drop]
    table = best(rows)
    text = markdown(table, a.compact)
    sys.stdout.write(text)
    if a.markdown:
        Path(a.markdown).write_text(text)
    if a.readme:
        readme = Path(a.readme)
        readme.write_text(readme_column(readme.read_text(), table))
    return 0


if __name__ == "__main__":
    sys.exit(main())
