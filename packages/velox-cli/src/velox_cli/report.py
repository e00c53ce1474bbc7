"""The results table of ``velox bench``."""

from __future__ import annotations

import math

from rich.table import Table

from .evaluate import Row, rows_from_json

__all__ = [
    "best_at",
    "closing_lines",
    "console",
    "layout",
    "markdown",
    "methods_table",
    "ppl_noise",
    "print_report",
    "rows_from_json",
    "table",
    "wrap_spec",
]

COLUMNS = (
    "spec",
    "held bytes/token",
    "vs fp16 held",
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


# The table's own column heads (narrow: a head breaks where a cell would not).
HEADS = {
    "spec": "spec",
    "held bytes/token": "held\nB/\ntoken",
    "vs fp16 held": "vs\nfp16\nheld",
    "KL": "KL",
    "top-1": "top-1",
    "ppl": "ppl",
    "recall": "recall",
    "prefill tok/s": "prefill\ntok/s",
    "decode tok/s": "decode\ntok/s",
    "prefill peak MiB": "prefill\npeak MiB",
    "peak MiB": "peak\nMiB",
    "non-finite": "non-\nfinite",
}
# Left out of the terminal table, in this order, while the spec column would be narrower
# than its longest spec and a SPEC_SHARE-th of the table (the rest are always shown; --json
# and --markdown keep every column).
DROP_ORDER = (
    "prefill peak MiB",
    "prefill tok/s",
    "peak MiB",
    "ppl",
    "decode tok/s",
    "recall",
    "top-1",
)
SPEC_SHARE = 3
MIN_SPEC_WIDTH = 12
FRONT_MARK = "*"
# The operating points of the closing lines, in compression against fp16, and the band
# around each (a row counts for x if its compression is within x / BAND .. x * BAND).
POINTS = (4.0, 8.0)
BAND = 1.25


def wrap_spec(spec: str, width: int, indent: str = "  ") -> list[str]:
    """``spec`` in lines of at most ``width`` characters, broken after commas (a part longer
    than a line is cut into pieces); lines after the first start with ``indent``."""
    width = max(width, len(indent) + 1)
    lines: list[str] = []
    cur = ""
    for part in spec.replace(",", ",\0").split("\0"):
        if cur.strip() and len(cur) + len(part) > width:
            lines.append(cur)
            cur = indent
        cur += part
        while len(cur) > width:
            lines.append(cur[:width])
            cur = indent + cur[width:]
    return [*lines, cur]


def console(**kw):
    """A rich Console for the bench and methods tables: the terminal's width (or ``COLUMNS``);
    120 columns when the output is not a terminal and ``COLUMNS`` is not set."""
    import os

    from rich.console import Console

    c = Console(**kw)
    if "width" not in kw and not c.is_terminal and not os.environ.get("COLUMNS", "").isdigit():
        c = Console(width=120, **kw)
    return c


def _fmt_ratio(x: float) -> str:
    return f"{x:.1f}".rstrip("0").rstrip(".") + "x"


def best_at(rows: list[Row], point: float, band: float = BAND) -> tuple[int | None, int]:
    """The row with the lowest KL (fewer bytes breaking a tie) among the error-free rows with
    a finite KL whose compression against fp16 lies within ``point / band .. point * band``:
    its index (None if no row is there) and how many rows are there."""
    lo, hi = point / band, point * band
    near = [
        i
        for i, r in enumerate(rows)
        if r.error is None
        and isinstance(r.kl, (int, float))
        and math.isfinite(r.kl)
        and isinstance(r.compression_ratio, (int, float))
        and lo <= r.compression_ratio <= hi
    ]
    if not near:
        return None, 0
    return min(near, key=lambda i: (rows[i].kl, rows[i].bytes_per_token)), len(near)


def closing_lines(rows: list[Row], info: dict) -> list[str]:
    """The best row near each operating point of :data:`POINTS` (see :func:`best_at`), or
    that no row is near it: a heading line, then a line per point."""
    from pathlib import Path

    model = Path(str(info.get("model", "the model"))).name
    bands = " and ".join(f"{_fmt_ratio(p / BAND)}-{_fmt_ratio(p * BAND)}" for p in POINTS)
    out = [f"best setting on {model} (lowest KL among rows {bands} fewer held bytes than fp16):"]
    for point in POINTS:
        i, _ = best_at(rows, point)
        head = f"  about {_fmt_ratio(point)}:"
        if i is None:
            lo, hi = _fmt_ratio(point / BAND), _fmt_ratio(point * BAND)
            out.append(f"{head} no row measured {lo}-{hi} fewer held bytes than fp16")
        else:
            r = rows[i]
            out.append(f"{head} #{i + 1} {r.spec} ({r.compression_ratio:.2f}x, KL {r.kl:.4f})")
    return out


def _shown(rows: list[Row]) -> list[str]:
    """The numeric columns worth a column at any width (non-finite only when a row has one)."""
    bad = any(r.nonfinite_steps or r.nonfinite_layers for r in rows if not r.error)
    return [c for c in COLUMNS[1:] if c != "non-finite" or bad]


def _build(rows: list[Row], info: dict, cols: list[str], spec_width: int) -> tuple[Table, set]:
    from rich import box
    from rich.text import Text

    from .chart import front_rows

    front = set(front_rows(rows))
    t = Table(
        title=f"velox bench: {info['model']} | context {info['context']} | {info['backend']} "
        f"| cache storage {info.get('storage_dtype') or 'model dtype'}",
        box=box.SIMPLE_HEAD,
        pad_edge=False,
        show_edge=False,
    )
    t.add_column("#", justify="right", no_wrap=True)
    t.add_column("spec", justify="left", width=spec_width, overflow="fold")
    for c in cols:
        kw = {"max_width": 9} if c == "non-finite" else {"no_wrap": True}
        t.add_column(HEADS[c], justify="right", **kw)
    wrapped = set()
    for i, r in enumerate(rows):
        lines = wrap_spec(r.spec, spec_width)
        if len(lines) > 1:
            wrapped.add(i)
        spec = Text("\n".join(lines))
        mark = (FRONT_MARK if i in front else "") + str(i + 1)
        if r.error:
            spec.append("\nerror: " + r.error[:200], style="red")
            t.add_row(mark, spec, *[""] * len(cols))
            continue
        cells = dict(zip(COLUMNS, _cells(r), strict=True))
        t.add_row(mark, spec, *[cells[c] for c in cols], style="bold" if i in front else None)
    return t, wrapped


def layout(rows: list[Row], width: int) -> tuple[list[str], int]:
    """The numeric columns the table shows at ``width`` characters and its spec column's
    width: columns are left out (:data:`DROP_ORDER`) only while the spec column would be
    narrower than both its longest spec and ``width / SPEC_SHARE``."""
    cols = _shown(rows)
    target = _spec_target(rows, width)
    longest = max([len(r.spec) for r in rows] + [4])
    drop = [c for c in DROP_ORDER if c in cols]
    while True:
        avail = width - _other_width(rows, cols)
        if avail >= target or not drop:
            return cols, max(MIN_SPEC_WIDTH, min(longest, avail))
        cols = [c for c in cols if c != drop[0]]
        drop = drop[1:]


def _spec_target(rows: list[Row], width: int) -> int:
    longest = max([len(r.spec) for r in rows] + [4])
    return min(longest, max(MIN_SPEC_WIDTH, width // SPEC_SHARE))


def _other_width(rows: list[Row], cols: list[str]) -> int:
    """The table's width but its spec column's (measured with every spec one character)."""
    import dataclasses

    from rich.console import Console

    probe = [dataclasses.replace(r, spec="x", error=None) for r in rows]
    t, _ = _build(probe, {"model": "", "context": 0, "backend": ""}, cols, 1)
    return Console(width=100_000).measure(t).maximum - 1


def notes(rows: list[Row], info: dict, cols: list[str]) -> list[str]:
    """The lines under the table: what its marks and missing columns mean, the run's notes."""
    from .chart import drawable, kl_floor

    out = [
        f"{FRONT_MARK}, bold: on the Pareto front, as ringed in the chart: no other row has both "
        "fewer held bytes/token and a lower KL"
        + (
            f" (KLs at or below {kl_floor([r.kl for r in rows if drawable(r)]):.0e} count as equal)"
            if any(drawable(r) for r in rows)
            else ""
        )
    ]
    tokens = info.get("fp16_tokens")
    out.append(
        "held bytes: the bytes of the tokens a cache holds, every cache counted alike, fp16 "
        "and mlx-lm's quantized caches included: the rows of its arrays that hold tokens, with "
        "a velox cache's fitted and policy state, not the buffers' unused capacity (--json "
        "gives it in resident_bytes); vs fp16 held: fp16's held bytes over the row's"
        + (f", on the same {tokens:,} tokens" if isinstance(tokens, int) else "")
    )
    noise = ppl_noise(rows, info)
    if noise:
        out.append(noise)
    if "non-finite" not in _shown(rows):
        out.append("non-finite: no row had NaN/inf log-probs or cache entries")
    left = [c for c in _shown(rows) if c not in cols]
    if left:
        other = need = _other_width(rows, _shown(rows))  # the narrowest terminal showing all
        while need - other < _spec_target(rows, need):
            need += 1
        out.append(
            f"left out at this width: {', '.join(left)} (a terminal of {need} columns or "
            f"COLUMNS={need} shows them; --json and --markdown keep every column)"
        )
    for skip in info.get("skipped") or []:
        out.append(f"skipped {skip['spec']}: {skip['reason']}")
    if info.get("jobs", 1) > 1:
        out.append(JOBS_NOTE.format(jobs=info["jobs"]))
    if "transfer" in info:
        out.append(TRANSFER_NOTE.format(**info["transfer"]))
    return out


def ppl_noise(rows: list[Row], info: dict) -> str:
    """A note on the rows whose perplexity is below fp16's (a lossy cache does not predict
    better): the band of fp16's own perplexity over the scored tokens, two standard errors of
    its mean token loss (``info["fp16_nll_se"]``), within which such differences are sample
    noise. "" when no row is below fp16's."""
    ref = info.get("fp16_ppl")
    if not isinstance(ref, (int, float)) or not math.isfinite(ref):
        return ""
    below = [
        i
        for i, r in enumerate(rows)
        if r.error is None
        and r.method != "fp16"
        and isinstance(r.ppl, (int, float))
        and math.isfinite(r.ppl)
        and r.ppl < ref
    ]
    if not below:
        return ""
    se, n = info.get("fp16_nll_se"), info.get("scored_tokens")
    marks = ", ".join(f"#{i + 1}" for i in below)
    band = ""
    if isinstance(se, (int, float)) and math.isfinite(se):
        pct = (math.exp(2 * se) - 1) * 100
        band = f"; over these {n} scored tokens fp16's own perplexity is uncertain by +-{pct:.0f}%"
        band += " (two standard errors of its mean token loss)"
    verb = "prints" if len(below) == 1 else "print"
    return (
        f"ppl: {marks} {verb} a lower perplexity than fp16's {ref:.3f}{band}: sample noise, "
        "not a better cache (a lossy cache's KL against fp16 is its loss; --samples and "
        "--continuation score more tokens)"
    )


def table(rows: list[Row], info: dict, width: int = 120) -> Table:
    """The results as a rich Table that fits ``width`` characters (see :func:`layout`); specs
    longer than their column are broken after commas (:func:`print_report` lists them whole)."""
    cols, spec_width = layout(rows, width)
    return _build(rows, info, cols, spec_width)[0]


def print_report(con, rows: list[Row], info: dict) -> None:
    """Print the table at ``con``'s width, the notes, every spec the table broke over lines
    whole (to copy), and the best row at about 4x and 8x fewer bytes (:func:`closing_lines`)."""
    cols, spec_width = layout(rows, con.width)
    t, wrapped = _build(rows, info, cols, spec_width)
    con.print(t)
    for line in notes(rows, info, cols):
        con.print(line, highlight=False, markup=False)
    if wrapped:
        con.print("specs broken over lines above, whole:", highlight=False)
        for i in sorted(wrapped):
            con.print(f"  #{i + 1} {rows[i].spec}", soft_wrap=True, highlight=False, markup=False)
    head, *best = closing_lines(rows, info)
    con.print(head, highlight=False, markup=False)
    for line in best:
        con.print(line, soft_wrap=True, highlight=False, markup=False)


def methods_table(methods: list[dict], width: int) -> tuple[Table, list[str]]:
    """``velox methods``' table at ``width`` characters: each method's summary and parameters
    (defaults), and its recommended specs whole (``name:params``, one a line, broken after
    commas where longer than their column, which takes up to half the free width). Returns
    the table and the specs it broke, to list whole under it."""
    from rich.text import Text

    def spec(name: str, params: dict) -> str:
        return name + (":" + ",".join(f"{k}={v}" for k, v in params.items()) if params else "")

    recs = [[spec(m["name"], r) for r in m["recommended"]] for m in methods]
    longest = max([len(s) for rs in recs for s in rs] + [len("recommended")])
    name_w = max([len(m["name"]) for m in methods] + [len("method")])
    free = width - name_w - (3 * 3 + 1)  # three columns: borders and padding
    rec_w = min(longest, max(MIN_SPEC_WIDTH, free // 2))
    t = Table(title="installed velox methods")
    t.add_column("method", no_wrap=True)
    t.add_column("summary; parameters (defaults)", overflow="fold")
    t.add_column("recommended", width=rec_w, overflow="fold")
    broken = []
    for m, rs in zip(methods, recs, strict=True):
        params = ", ".join(  # a text holding newlines (KVzip's prompts) as Python writes it
            f"{k}={v!r}" if isinstance(v, str) and not v.isprintable() else f"{k}={v}"
            for k, v in m["parameters"].items()
        )
        lines = []
        for s in rs:
            parts = wrap_spec(s, rec_w)
            lines += parts
            if len(parts) > 1:
                broken.append(s)
        about = Text(m["summary"] + (f"\n{m['paper']}" if m["paper"] else ""))
        if params:
            about.append("\ndefaults: " + params, style="dim")
        t.add_row(m["name"], about, "\n".join(lines) or "-")
    return t, broken


def markdown(rows: list[Row]) -> str:
    """The same table in Markdown (for docs)."""
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(_cells(r)) + " |" for r in rows]
    return "\n".join(lines)
