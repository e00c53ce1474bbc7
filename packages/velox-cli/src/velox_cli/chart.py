"""The quality-memory chart of ``velox bench``: KL against cache bytes per token.

One point per row of ``velox bench --json`` (rows with an error, no bytes or no KL are left
out and counted in the footnote), coloured by the method's family (:data:`FAMILY`), shaped by
method within its family, numbered, with a key beside the plot listing every spec by number.
The Pareto front (rows no other row beats on both bytes and KL) is drawn as a staircase and
its points ringed. fp16 (mlx-lm's ``KVCache``) and mlx-lm's ``QuantizedKVCache`` rows are the
references: black, named in the plot, fp16's bytes per token a dashed vertical line and the
compression against it on the top axis.

KL is on a log axis floored at :func:`kl_floor`: fp16's KL against itself is exactly 0 and
a KL below :data:`NOISE_FLOOR` is float32 rounding of the log-probabilities, so neither has a
place on a log axis. Rows at or below the floor are drawn on the floor line, and for the
Pareto front KLs below the floor count as equal.

Redraw a chart from saved rows without re-running the bench::

    python -m velox_cli.chart rows.json chart.png
"""

from __future__ import annotations

import argparse
import itertools
import math
import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from .evaluate import Row

__all__ = [
    "DEFAULT_FLOOR",
    "FAMILIES",
    "FAMILY",
    "NOISE_FLOOR",
    "chart",
    "drawable",
    "family",
    "front_rows",
    "kl_floor",
    "main",
    "pareto",
]

# Families in the order the legend and the key list them, with their colours.
FAMILIES: dict[str, str] = {
    "baselines": "black",
    "quantizers": "tab:blue",
    "vector quantizers": "tab:purple",
    "eviction": "tab:orange",
    "latent / cross-layer": "tab:green",
    "other": "tab:gray",
}

# Method name (a spec's part before ':') -> family. A composed spec ``A+B`` takes A's family
# (A decides which tokens stay, B only stores them); a name not listed here is "other".
FAMILY: dict[str, str] = {
    "fp16": "baselines",
    "mlx-q4": "baselines",
    "mlx-q8": "baselines",
    "uniform": "quantizers",
    "kivi": "quantizers",
    "kvquant": "quantizers",
    "skvq": "quantizers",
    "agetiered": "quantizers",
    "qjl": "quantizers",
    "rabitq": "quantizers",
    "turboquant": "quantizers",
    "oscar": "quantizers",
    "spectral": "quantizers",
    "vecinfer": "vector quantizers",
    "commvq": "vector quantizers",
    "streamingllm": "eviction",
    "snapkv": "eviction",
    "adakv": "eviction",
    "qfilters": "eviction",
    "nestedkv": "eviction",
    "palu": "latent / cross-layer",
    "svdq": "latent / cross-layer",
    "xkv": "latent / cross-layer",
    "minicache": "latent / cross-layer",
}

# Below this a KL is float32 rounding: log-probabilities of magnitude ~10 carry an ulp of
# ~1e-6, and KL is a p-weighted sum of their differences.
NOISE_FLOOR = 1e-6
# The floor when no row measures below it (mlx-q8 and other 8-bit caches land near 1e-4).
DEFAULT_FLOOR = 1e-4

_MARKERS = ("o", "s", "^", "D", "v", "P", "X", "h", "<", ">", "p", "*")


def family(method: str) -> str:
    """The family of ``method`` (a row's ``method``: a name, ``A+B`` or ``mlx-qB``)."""
    if not isinstance(method, str):
        raise TypeError(f"family: method must be a str, got {type(method).__name__}")
    first = method.split("+", 1)[0].split(":", 1)[0]
    if first in FAMILY:
        return FAMILY[first]
    if first.startswith("mlx-q"):
        return "baselines"
    return "other"


def kl_floor(kls: Sequence[float]) -> float:
    """Where the KL axis stops: :data:`DEFAULT_FLOOR`, or the decade below the smallest KL
    above :data:`NOISE_FLOOR` when one is lower; never below the noise floor."""
    low = [k for k in kls if math.isfinite(k) and k > NOISE_FLOOR]
    if not low or min(low) >= DEFAULT_FLOOR:
        return DEFAULT_FLOOR
    return max(NOISE_FLOOR, 10.0 ** math.floor(math.log10(min(low))))


def pareto(points: Sequence[tuple[float, float]]) -> list[int]:
    """Indices of the points no other point dominates (both coordinates lower is better: one
    point dominates another if it is no worse on both and better on one), by rising x.
    Identical points are all kept."""
    for p in points:
        if len(p) != 2 or not all(isinstance(v, (int, float)) and math.isfinite(v) for v in p):
            raise ValueError(f"pareto: points must be pairs of finite numbers, got {p!r}")
    front = [
        i
        for i, (x, y) in enumerate(points)
        if not any(
            (u <= x and v <= y) and (u < x or v < y) for j, (u, v) in enumerate(points) if j != i
        )
    ]
    return sorted(front, key=lambda i: (points[i][0], points[i][1]))


@dataclass
class _Point:
    row: Row
    family: str
    x: float  # KiB per token
    y: float  # KL, floored
    number: int = 0
    marker: str = "o"
    front: bool = False

    @property
    def reference(self) -> bool:
        return self.family == "baselines"


def drawable(r: Row) -> bool:
    """Whether the chart draws ``r``: no error, bytes per token above 0 and a finite KL."""
    return (
        r.error is None
        and isinstance(r.bytes_per_token, (int, float))
        and r.bytes_per_token > 0
        and isinstance(r.kl, (int, float))
        and math.isfinite(r.kl)
    )


def front_rows(rows: Sequence[Row]) -> list[int]:
    """Indices into ``rows`` of the Pareto front the chart rings, by rising bytes: among the
    :func:`drawable` rows, those no other row beats on both bytes per token and KL, KLs at
    or below :func:`kl_floor` counting as equal (``velox bench``'s table marks the same)."""
    drawn = [i for i, r in enumerate(rows) if drawable(r)]
    floor = kl_floor([rows[i].kl for i in drawn])
    pts = [(rows[i].bytes_per_token, max(rows[i].kl, floor)) for i in drawn]
    return [drawn[j] for j in pareto(pts)]


def _points(rows: Sequence[Row]) -> tuple[list[_Point], list[Row], float]:
    drawn = [r for r in rows if drawable(r)]
    skipped = [r for r in rows if not drawable(r)]
    floor = kl_floor([r.kl for r in drawn])
    pts = [_Point(r, family(r.method), r.bytes_per_token / 1024, max(r.kl, floor)) for r in drawn]
    front = {id(rows[i]) for i in front_rows(rows)}
    for p in pts:
        p.front = id(p.row) in front
    # Key order: family, then method (first seen), then most bytes first; markers cycle per
    # method within a family.
    order = list(FAMILIES)
    methods: dict[str, list[str]] = {}
    for p in pts:
        m = methods.setdefault(p.family, [])
        if p.row.method not in m:
            m.append(p.row.method)
    for p in pts:
        ms = methods[p.family]
        p.marker = _MARKERS[ms.index(p.row.method) % len(_MARKERS)]
    pts.sort(key=lambda p: (order.index(p.family), methods[p.family].index(p.row.method), -p.x))
    for n, p in enumerate(pts, 1):
        p.number = n
    return pts, skipped, floor


def _wrap(text: str, width: int) -> list[str]:
    """``text`` in lines of at most ``width`` characters, broken after commas."""
    lines, cur = [], ""
    for part in text.replace(",", ",\0").split("\0"):
        if cur and len(cur) + len(part) > width:
            lines.append(cur)
            cur = "    " + part
        else:
            cur += part
    return [*lines, cur]


def _overlap(a, b) -> float:
    w = min(a.x1, b.x1) - max(a.x0, b.x0)
    h = min(a.y1, b.y1) - max(a.y0, b.y0)
    return w * h if w > 0 and h > 0 else 0.0


def _line_boxes(ax, xs: Sequence[float], ys: Sequence[float], width: float = 3.0) -> list:
    """Display-space boxes ``width`` pixels thick around each axis-parallel segment of the
    polyline through (xs, ys) (data coordinates), for labels to stay off it."""
    from matplotlib.transforms import Bbox

    pix = ax.transData.transform(list(zip(xs, ys, strict=True)))
    boxes = []
    for (x0, y0), (x1, y1) in itertools.pairwise(pix):
        boxes.append(
            Bbox.from_extents(
                min(x0, x1) - width, min(y0, y1) - width, max(x0, x1) + width, max(y0, y1) + width
            )
        )
    return boxes


def _place_labels(ax, pts: list[_Point], texts: list[str], avoid: list) -> list:
    """Annotate each point with its text at the first offset whose box collides with no
    marker (its own included), no label placed before it and nothing in ``avoid``
    (display-space boxes), inside the axes; else at the offset with the least overlap.
    Returns the labels' boxes."""
    from matplotlib.transforms import Bbox

    fig = ax.figure
    renderer = fig.canvas.get_renderer()
    frame = ax.get_window_extent(renderer)
    dpi = fig.dpi / 72  # pixels per point
    centres = [ax.transData.transform((p.x, p.y)) for p in pts]
    # A marker's box, or the ring around a front point's (radius in points, scaled to pixels).
    radius = [(8.0 if p.front else 4.5) * dpi for p in pts]
    markers = [
        Bbox.from_extents(cx - r, cy - r, cx + r, cy + r)
        for (cx, cy), r in zip(centres, radius, strict=True)
    ]
    directions = [(1, 0), (1, 1), (1, -1), (-1, 0), (-1, 1), (-1, -1), (0, 1), (0, -1)]
    offsets = [(dx * d, dy * d) for d in (6, 9, 13, 19, 27, 38, 52) for dx, dy in directions]
    placed: list = []
    # Front and references first: they get the closest spots.
    order = sorted(range(len(pts)), key=lambda i: (not (pts[i].front or pts[i].reference), i))
    for i in order:
        best = None
        for ox, oy in offsets:
            ha = "left" if ox > 0 else "right" if ox < 0 else "center"
            va = "bottom" if oy > 0 else "top" if oy < 0 else "center"
            t = ax.annotate(
                texts[i],
                (pts[i].x, pts[i].y),
                xytext=(ox, oy),
                textcoords="offset points",
                ha=ha,
                va=va,
                fontsize=7,
                fontweight="bold" if pts[i].front or pts[i].reference else "normal",
                color=FAMILIES[pts[i].family],
                zorder=5,
            )
            box = t.get_window_extent(renderer).expanded(1.08, 1.15)
            outside = box.x0 < frame.x0 or box.x1 > frame.x1 or box.y0 < frame.y0
            outside = outside or box.y1 > frame.y1
            cost = sum(_overlap(box, b) for b in placed + avoid)
            cost += sum(_overlap(box, m) for m in markers)  # its own marker too
            cost += 1e9 if outside else 0.0
            if best is None or cost < best[0]:
                if best is not None:
                    best[1].remove()
                best = (cost, t, box, (ox, oy))
            else:
                t.remove()
            if cost == 0:
                break
        _, _, box, (ox, oy) = best
        if math.hypot(ox, oy) > 14:  # a far label gets a leader line back to its point
            ax.annotate(
                "",
                (pts[i].x, pts[i].y),
                xytext=(ox, oy),
                textcoords="offset points",
                arrowprops={"arrowstyle": "-", "color": "0.45", "lw": 0.6, "shrinkA": 0},
                zorder=1,
            )
        placed.append(box)
    return placed


def chart(path: str, rows: Sequence[Row], info: dict | None = None) -> None:
    """Draw ``rows`` (``velox bench`` results) as the quality-memory chart into ``path``
    (PNG, or another format matplotlib writes, chosen by the file's suffix).

    ``info``: the run's settings (``velox bench --json``'s ``run``), named in the title.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    fmt = Path(path).suffix.lstrip(".").lower() or "png"
    allowed = FigureCanvasAgg.get_supported_filetypes()
    if fmt not in allowed:
        raise ValueError(
            f"chart: cannot write {path!r}: suffix {fmt!r} is not one of {', '.join(allowed)}"
        )
    fig, _ = _figure(rows, info)
    fig.savefig(path, dpi=110, format=fmt)


def _figure(rows: Sequence[Row], info: dict | None):
    """The chart as a matplotlib Figure (on an Agg canvas) and its labels' display boxes."""
    import numpy as np
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.lines import Line2D
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    fig = Figure(figsize=(15, 8))
    FigureCanvasAgg(fig)
    pts, skipped, floor = _points(rows)
    # The key's height in lines: per family a heading and a gap above it (half a line above
    # the first, half a line left below the last), per spec its wrapped lines.
    key_lines = 2.0 * len({p.family for p in pts})
    key_lines += sum(len(_wrap(p.row.spec, 62)) for p in pts)
    fig.set_figheight(max(7.5, 0.15 * key_lines + 1.6))
    ax = fig.add_axes((0.06, 0.09, 0.56, 0.80))
    key = fig.add_axes((0.645, 0.03, 0.35, 0.94))
    key.set_axis_off()

    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("held cache bytes per token (KiB, every cache counted alike)")
    ax.set_ylabel("KL(fp16 || cache) per decode step")
    ax.grid(True, which="major", alpha=0.35)
    ax.grid(True, which="minor", alpha=0.12)
    context = sorted({p.row.context for p in pts})
    where = []
    if info and info.get("model"):
        where.append(Path(str(info["model"])).name)
    if context:
        where.append("context " + ", ".join(str(c) for c in context))
    ax.set_title(
        "velox bench: quality against cache memory" + (" | " if where else "") + ", ".join(where)
    )

    if not pts:
        ax.text(0.5, 0.5, "no rows with measured KL and bytes", ha="center", transform=ax.transAxes)
        ax.set_xlim(0.1, 10)
        ax.set_ylim(floor / 2, 1)
    else:
        xs = [p.x for p in pts]
        ys = [p.y for p in pts]
        ax.set_xlim(min(xs) / 1.25, max(xs) * 1.3)
        ax.set_ylim(floor / 2.2, max(ys) * 3)

    plain = FuncFormatter(lambda v, _: f"{v:g}")
    ax.xaxis.set_major_locator(LogLocator(subs=(1.0, 2.0, 5.0)))
    ax.xaxis.set_major_formatter(plain)
    ax.xaxis.set_minor_formatter(NullFormatter())

    # Floor line and the band under it.
    ax.axhline(floor, color="0.35", lw=0.8, ls=":", zorder=1)
    ax.axhspan(ax.get_ylim()[0], floor, color="0.93", zorder=0)
    ax.text(
        0.005,
        floor,
        f" floor {floor:.0e}: a KL at or below it is drawn on this line (fp16 vs itself: 0)",
        transform=ax.get_yaxis_transform(),
        ha="left",
        va="top",
        fontsize=7,
        color="0.3",
    )

    fp16 = next((p for p in pts if p.row.method == "fp16"), None)
    if fp16 is not None:
        ax.axvline(fp16.x, color="black", lw=0.8, ls="--", zorder=1)
        ref = fp16.x
        # x <-> fp16's bytes / x (its own inverse); matplotlib probes 0 and negatives.
        inv = lambda v: ref / np.maximum(v, 1e-12)  # noqa: E731
        top = ax.secondary_xaxis("top", functions=(inv, inv))
        top.set_xlabel("compression against the fp16 cache (x)")
        top.xaxis.set_major_locator(LogLocator(subs=(1.0, 1.5, 2.0, 3.0, 5.0, 7.0)))
        top.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}x"))
        top.xaxis.set_minor_formatter(NullFormatter())

    front = sorted((p for p in pts if p.front), key=lambda p: (p.x, p.y))
    if front:
        fx = [p.x for p in front]
        fy = [p.y for p in front]
        # The staircase: from each front point KL stays at its level until the next (more
        # bytes, lower KL) front point.
        ax.step(fx, fy, where="post", color="crimson", lw=1.2, alpha=0.7, zorder=2)
        ax.scatter(fx, fy, s=150, facecolors="none", edgecolors="crimson", lw=1.2, zorder=3)
    for p in pts:
        ref_marker = "*" if p.row.method == "fp16" else p.marker
        ax.scatter(
            p.x,
            p.y,
            marker=ref_marker,
            s=110 if ref_marker == "*" else 42,
            color=FAMILIES[p.family],
            edgecolors="white",
            linewidths=0.5,
            zorder=4,
        )

    handles = [
        Line2D([], [], ls="", marker="o", color=c, label=f)
        for f, c in FAMILIES.items()
        if any(p.family == f for p in pts)
    ]
    handles.append(
        Line2D([], [], color="crimson", marker="o", mfc="none", ms=10, label="Pareto front")
    )
    if fp16 is not None:
        handles.append(Line2D([], [], color="black", ls="--", label="fp16 cache's bytes"))
    legend = ax.legend(handles=handles, loc="upper right", fontsize=8, framealpha=0.9)

    fig.canvas.draw()
    avoid = [legend.get_window_extent(fig.canvas.get_renderer())]
    avoid += [t.get_window_extent(fig.canvas.get_renderer()) for t in ax.texts]
    if front:  # the staircase's corners: each front point, then (next x, this KL)
        sx = [v for a, b in zip(fx, [*fx[1:], fx[-1]], strict=True) for v in (a, b)]
        sy = [v for v in fy for _ in (0, 1)]
        avoid += _line_boxes(ax, sx, sy)
    if fp16 is not None:
        avoid += _line_boxes(ax, [fp16.x, fp16.x], list(ax.get_ylim()))
    labels = [p.row.spec if p.reference else str(p.number) for p in pts]
    boxes = _place_labels(ax, pts, labels, avoid)

    # The key: every drawn spec by number, under its family; front members bold.
    y, step = 1.0, 1.0 / max(key_lines, 42)
    cur = None
    for p in pts:
        if p.family != cur:
            cur = p.family
            y -= step * (0.5 if p.number == 1 else 1.0)
            key.text(0.0, y, cur, fontsize=8.5, fontweight="bold", color=FAMILIES[cur], va="center")
            y -= step
        marker = "*" if p.row.method == "fp16" else p.marker
        key.scatter(0.012, y, marker=marker, s=28, color=FAMILIES[p.family], clip_on=False)
        weight = "bold" if p.front else "normal"
        key.text(0.035, y, f"{p.number:>2}", fontsize=7.5, va="center", fontweight=weight)
        for line in _wrap(p.row.spec, 62):
            key.text(0.085, y, line, fontsize=7.5, va="center", fontweight=weight)
            y -= step
    key.set_xlim(0, 1)
    key.set_ylim(0, 1)

    notes = ["bold: on the Pareto front (no row has both fewer bytes and lower KL)"]
    if skipped:
        named = [f"{r.spec} ({'error' if r.error else 'no KL or bytes'})" for r in skipped[:6]]
        more = f" and {len(skipped) - 6} more" if len(skipped) > 6 else ""
        notes.append(f"not drawn ({len(skipped)}): " + ", ".join(named) + more)
    fig.text(0.06, 0.012, "\n".join(_wrap("; ".join(notes), 150)), fontsize=7, color="0.3")
    return fig, boxes


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m velox_cli.chart ROWS.json OUT.png``: redraw a chart from saved rows."""
    from .evaluate import rows_from_json

    ap = argparse.ArgumentParser(
        prog="python -m velox_cli.chart",
        description="Draw the quality-memory chart of a `velox bench --json` file.",
    )
    ap.add_argument("rows", help="a `velox bench --json` file")
    ap.add_argument("out", help="the chart to write (.png, or .svg/.pdf)")
    a = ap.parse_args(argv)
    rows, info = rows_from_json(a.rows)
    chart(a.out, rows, info)
    print(f"chart written to {os.path.abspath(a.out)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
