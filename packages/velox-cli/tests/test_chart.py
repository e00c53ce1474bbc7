"""The quality-memory chart: families, KL floor, Pareto front, labels, the redraw command."""

import itertools
import json

import pytest

from velox_cli.bench import write_json
from velox_cli.chart import (
    DEFAULT_FLOOR,
    NOISE_FLOOR,
    _figure,
    _points,
    chart,
    family,
    kl_floor,
    main,
    pareto,
)
from velox_cli.evaluate import Row

PNG = b"\x89PNG\r\n\x1a\n"


def row(spec, kib, kl, error=None):
    method = "+".join(part.split(":", 1)[0] for part in spec.split("+"))  # as specs.parse
    return Row(spec, method, {}, 4096, bytes_per_token=kib * 1024, kl=kl, error=error)


def test_family_from_the_table_composed_specs_and_fallback():
    assert family("fp16") == family("mlx-q4") == family("mlx-q3") == "baselines"
    assert family("kivi") == family("turboquant") == "quantizers"
    assert family("vecinfer") == family("commvq") == "vector quantizers"
    assert family("snapkv") == family("streamingllm") == "eviction"
    assert family("xkv") == family("palu") == "latent / cross-layer"
    assert family("qfilters+turboquant") == "eviction"  # the first part decides
    assert family("transfer") == family("someone-elses") == "other"
    with pytest.raises(TypeError, match="method must be a str"):
        family(None)


def test_kl_floor():
    assert kl_floor([0.0, 0.01, 0.5]) == DEFAULT_FLOOR
    assert kl_floor([0.0, 6.9e-5, 0.1]) == pytest.approx(1e-5)  # the decade below mlx-q8's
    assert kl_floor([0.0, 1e-9, 0.1]) == DEFAULT_FLOOR  # rounding noise does not count
    assert kl_floor([3e-6]) == pytest.approx(NOISE_FLOOR)
    assert kl_floor([]) == DEFAULT_FLOOR


def test_pareto_on_a_hand_made_example():
    pts = [(1, 0.5), (2, 0.1), (2, 0.3), (3, 0.1), (0.5, 0.9), (4, 0.0), (1, 0.5), (5, 0.2)]
    # (2, 0.3) and (3, 0.1) lose to (2, 0.1), (5, 0.2) to (4, 0.0); the two (1, 0.5) tie.
    assert pareto(pts) == [4, 0, 6, 1, 5]
    assert pareto([]) == []
    with pytest.raises(ValueError, match="pairs of finite numbers"):
        pareto([(1.0, float("nan"))])


def test_chart_points_floor_families_and_front():
    rows = [
        row("fp16", 6.0, 0.0),
        row("mlx-q4", 1.8, 0.05),
        row("kivi:bits=4", 1.7, 0.002),  # beats mlx-q4 on both
        row("kivi:bits=2", 1.0, 0.04),
        row("snapkv:budget=1024", 0.9, 0.09),
        row("qfilters:budget=1024+turboquant:bits=3", 0.2, 1.0),
        row("uniform:bits=8", 3.4, 2e-4),
        row("vecinfer:bits=2", 0.8, float("nan")),  # no KL: left out
        row("xkv:rank=0.5", 2.0, 0.5, error="ValueError: broken"),  # error: left out
    ]
    pts, skipped, floor = _points(rows)
    assert floor == DEFAULT_FLOOR
    assert {r.spec for r in skipped} == {"vecinfer:bits=2", "xkv:rank=0.5"}
    by = {p.row.spec: p for p in pts}
    assert by["fp16"].y == DEFAULT_FLOOR  # KL 0 drawn on the floor
    assert by["qfilters:budget=1024+turboquant:bits=3"].family == "eviction"
    front = {p.row.spec for p in pts if p.front}
    assert front == {
        "qfilters:budget=1024+turboquant:bits=3",
        "snapkv:budget=1024",
        "kivi:bits=2",
        "kivi:bits=4",
        "uniform:bits=8",
        "fp16",
    }
    # Numbered in key order: baselines first, then by family.
    assert [p.row.spec for p in pts[:2]] == ["fp16", "mlx-q4"]
    assert [p.number for p in pts] == list(range(1, len(pts) + 1))


def test_kl_below_the_floor_counts_as_equal_on_the_front():
    # A lossless cache at fewer bytes than fp16 (KL at rounding level) dominates fp16.
    pts, _, _ = _points([row("fp16", 6.0, 0.0), row("kivi:bits=8", 3.0, 1e-9)])
    assert {p.row.spec for p in pts if p.front} == {"kivi:bits=8"}


def test_chart_writes_a_png_and_labels_do_not_collide(tmp_path):
    # A crowd: 24 points in a narrow band plus the references.
    rows = [row("fp16", 6.3, 0.0), row("mlx-q4", 1.8, 0.049), row("mlx-q8", 3.4, 7e-5)]
    for i, (m, b) in enumerate(itertools.product(("kivi", "skvq", "snapkv", "vecinfer"), range(6))):
        rows.append(row(f"{m}:bits={b + 2}", 0.9 + 0.05 * i, 0.02 * (1 + (i * 7) % 11)))
    out = tmp_path / "chart.png"
    chart(str(out), rows)
    assert out.read_bytes()[:8] == PNG and out.stat().st_size > 20_000
    fig, boxes = _figure(rows, None)
    assert len(boxes) == len(rows)
    frame = fig.axes[0].get_window_extent(fig.canvas.get_renderer())
    for a, b in itertools.combinations(boxes, 2):
        assert not a.overlaps(b), (a, b)
    for b in boxes:
        assert frame.x0 <= b.x0 and b.x1 <= frame.x1 and frame.y0 <= b.y0 and b.y1 <= frame.y1


def test_chart_without_drawable_rows_still_writes(tmp_path):
    out = tmp_path / "empty.png"
    chart(str(out), [row("kivi", 1.0, 0.1, error="RuntimeError: x")])
    assert out.read_bytes()[:8] == PNG


def test_chart_rejects_an_unknown_format(tmp_path):
    with pytest.raises(ValueError, match="suffix 'bogus' is not one of"):
        chart(str(tmp_path / "chart.bogus"), [row("fp16", 6.0, 0.0)])


def test_redraw_from_saved_json(tmp_path, capsys):
    rows = [row("fp16", 6.0, 0.0), row("kivi:bits=4", 1.7, 0.002), row("kivi:bits=2", 1.0, 0.04)]
    saved = tmp_path / "rows.json"
    write_json(str(saved), rows, {"model": "/models/tiny", "context": 4096})
    assert json.loads(saved.read_text())[0]["run"]["model"] == "/models/tiny"
    out = tmp_path / "redrawn.png"
    assert main([str(saved), str(out)]) == 0
    assert out.read_bytes()[:8] == PNG
    assert "chart written" in capsys.readouterr().out
