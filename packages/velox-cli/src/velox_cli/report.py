"""The results table of ``velox bench``."""

from __future__ import annotations

import math

from rich.table import Table

from .evaluate import Row

__all__ = ["markdown", "rows_from_json", "table"]

COLUMNS = (
    "spec",
    "bytes/token",
    "vs fp16",
    "KL",
    "top-1",
    "ppl",
    "recall",
    "prefill tok/s",
    "decode tok/s",
    "prefill peak MiB",
    "peak MiB",
    "non-finite",
)

TRANSFER_NOTE = (
    "transfer:source=NAME: this model decoding from {source}'s cache of the prefix, mapped "
    "into its own by the velox-transfer mapper {mapper} (no prefill of its own but the last "
    "prefix token); its prefill tok/s times the mapping and that token, not the source's "
    "prefill"
)


JOBS_NOTE = (
    "{jobs} specs measured at once, each in a worker process: speeds are beside the others' "
    "(--jobs 1 measures each spec alone)"
)


def _cells(r: Row) -> list[str]:
    if r.error:
        return [r.spec, "error: " + r.error[:60], *[""] * (len(COLUMNS) - 2)]

    def f(v, fmt):
        return "-" if v is None or (isinstance(v, float) and math.isnan(v)) else format(v, fmt)

    def q(v, fmt):  # quality: a NaN from non-finite logits is a result, not a gap
        return "NaN" if r.nonfinite_steps and math.isnan(v) else f(v, fmt)

    return [
        r.spec,
        f"{r.bytes_per_token:,.0f}",
        f(r.compression_ratio, ".2f") + "x",
        q(r.kl, ".4f"),
        q(r.top1, ".3f"),
        q(r.ppl, ".3f"),
        f(r.retrieval, ".2f"),
        f(r.prefill_tps, ",.0f"),
        f(r.decode_tps, ",.1f"),
        f(r.prefill_peak_memory / 2**20, ",.1f"),
        f(r.peak_memory / 2**20, ",.0f"),
        _nonfinite(r),
    ]


def _nonfinite(r: Row) -> str:
    """Steps with NaN/inf logits and layers whose cache holds NaN/inf ("0": none)."""
    if not (r.nonfinite_steps or r.nonfinite_layers):
        return "0"
    return f"{r.nonfinite_steps} steps, {r.nonfinite_layers} layers"


def table(rows: list[Row], info: dict) -> Table:
    t = Table(
        title=f"velox bench: {info['model']} | context {info['context']} | {info['backend']} "
        f"| cache storage {info.get('storage_dtype') or 'model dtype'}"
    )
    for c in COLUMNS:
        t.add_column(c, justify="left" if c == "spec" else "right")
    for r in rows:
        t.add_row(*_cells(r))
    notes = []
    if info.get("jobs", 1) > 1:
        notes.append(JOBS_NOTE.format(jobs=info["jobs"]))
    if "transfer" in info:
        notes.append(TRANSFER_NOTE.format(**info["transfer"]))
    if notes:
        t.caption = "\n".join(notes)
    return t


def markdown(rows: list[Row]) -> str:
    """The same table in Markdown (for docs)."""
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(_cells(r)) + " |" for r in rows]
    return "\n".join(lines)


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
