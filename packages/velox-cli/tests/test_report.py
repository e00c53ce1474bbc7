"""The terminal output of ``velox bench`` (table, Pareto marks, best at about 4x and 8x) and of
``velox methods``: it fits the terminal's width and never cuts a spec."""

import io
import re

import pytest
from rich.console import Console

from velox_cli.chart import front_rows
from velox_cli.evaluate import Row
from velox_cli.report import BAND, POINTS, best_at, closing_lines, layout, print_report

FP16 = 6400.0
LONG_A = "agetiered:recent_bits=8,middle_bits=6,old_bits=3,recent=64,middle=1216"
LONG_B = "agetiered:recent_bits=8,middle_bits=6,old_bits=3,recent=64,middle=64"
LONGEST = "skvq:key_bits=2,value_bits=1.5,key_group=64,value_group=128,window=128,sinks=5"
INFO = {"model": "/models/tiny-model", "context": 1024, "backend": "cpu"}


def row(spec, nbytes, kl, **kw):
    return Row(
        spec,
        spec.split(":")[0],
        {},
        1024,
        bytes_per_token=nbytes,
        compression_ratio=FP16 / nbytes,
        kl=kl,
        top1=0.9,
        ppl=8.5,
        retrieval=1.0,
        prefill_tps=1234.0,
        decode_tps=45.6,
        prefill_peak_memory=123 * 2**20,
        peak_memory=130 * 2**20,
        **kw,
    )


def crafted() -> list[Row]:
    """Rows whose Pareto front, by hand: #1 2 3 4 6 8 9 (5 and 7 lose to 4 on both bytes
    and KL, 12 to 9: the same bytes, higher KL; 10 is an error and 11's KL is NaN)."""
    return [
        row("fp16", FP16, 0.0),  # 1: KL 0, floored to 1e-4, the lowest
        row("mlx-q8", 3400, 2e-4),  # 2
        row(LONG_A, 1750, 4e-4),  # 3: 3.66x
        row(LONG_B, 1470, 0.0055),  # 4: 4.35x
        row("adakv:budget=1024", 1600, 0.05),  # 5: 4.0x
        row("adakv:budget=1024,bits=4", 800, 0.1),  # 6: 8.0x
        row("turboquant:bits=4", 1700, 0.03),  # 7: 3.76x
        row("turboquant:bits=2", 700, 0.5),  # 8: 9.14x
        row(LONGEST, 990, 0.08),  # 9: 6.46x
        row("qjl:key_bits=1,value_bits=2", 800, 0.0, error="ValueError: boom"),  # 10
        row("kivi:bits=2,group=32,window=128", 900, float("nan"), nonfinite_steps=3),  # 11
        row("uniform:bits=2", 990, 0.9),  # 12
    ]


FRONT = {1, 2, 3, 4, 6, 8, 9}


def render(rows, width, info=INFO) -> list[str]:
    buf = io.StringIO()
    con = Console(file=buf, width=width, color_system=None, force_terminal=False)
    print_report(con, rows, info)
    return buf.getvalue().splitlines()


def whole(spec: str, line: str) -> bool:
    """``spec`` stands in ``line`` whole: not cut, not a part of a longer spec."""
    return re.search(r"(^|\s)" + re.escape(spec) + r"(\s|$)", line) is not None


def table_lines(lines: list[str]) -> list[str]:
    return lines[: next(i for i, line in enumerate(lines) if line.startswith("*, bold"))]


@pytest.mark.parametrize("width", [150, 120, 100, 80, 60])
def test_the_table_fits_the_width_and_every_spec_can_be_copied_whole(width):
    rows = crafted()
    lines = render(rows, width)
    if width >= 120:  # every line, the key and the closing lines too
        assert max(map(len, lines)) <= width
    else:  # the table; the lines of one whole spec run longer and the terminal wraps them
        assert max(map(len, table_lines(lines))) <= width
    # each spec stands whole on its row's line, or under the table by its row's number
    key = {}
    for line in lines:
        m = re.fullmatch(r"  #(\d+) (\S+)", line)
        if m:
            key[int(m[1])] = m[2]
    for n, r in enumerate(rows, 1):
        if n in key:
            assert key[n] == r.spec
        else:
            assert any(re.match(rf"\s*\*?{n}\s", x) and whole(r.spec, x) for x in lines), r.spec
    assert LONGEST in key.values()  # the longest was broken in the table at these widths
    # no spec text is cut with an ellipsis, and the error is shown
    assert not any("…" in x for x in lines)
    assert any("error:" in x for x in lines) and any("boom" in x for x in lines)


def test_at_120_columns_the_speed_and_quality_columns_stay():
    cols, spec_width = layout(crafted(), 120)
    assert {
        "held bytes/token",
        "vs fp16 held",
        "KL",
        "top-1",
        "ppl",
        "recall",
        "decode tok/s",
    } <= set(cols)
    assert "non-finite" in cols  # a row has non-finite steps
    assert spec_width >= 40
    cols, spec_width = layout(crafted(), 200)
    assert spec_width == len(LONGEST) and "prefill peak MiB" in cols


def test_left_out_columns_are_named():
    lines = render(crafted(), 80)
    note = " ".join(x for x in lines if x.startswith("left out") or "COLUMNS=" in x)
    note = " ".join(note.split())
    assert "left out at this width:" in note and "prefill peak MiB" in note
    assert not any(x.startswith("left out") for x in render(crafted(), 200))


def test_the_marked_rows_are_the_pareto_front():
    rows = crafted()
    assert {i + 1 for i in front_rows(rows)} == FRONT
    for width in (120, 80):
        marked = {int(m[1]) for x in render(rows, width) if (m := re.match(r"\s*\*(\d+)\s", x))}
        assert marked == FRONT, width


def test_front_rows_count_kls_under_the_floor_as_equal():
    # 1e-8 and 0 are both under the noise floor: the row with fewer bytes wins alone
    rows = [row("a", 2000, 0.0), row("b", 1000, 1e-8), row("c", 500, 0.3)]
    assert front_rows(rows) == [2, 1]


def test_the_closing_lines_name_the_lowest_kl_near_4x_and_8x():
    rows = crafted()
    assert POINTS == (4.0, 8.0) and BAND == 1.25
    # 4x: rows 3, 4, 5, 7 lie within 3.2x-5x (2, at 1.88x, has a lower KL but is not near)
    assert best_at(rows, 4.0) == (2, 4)
    # 8x: rows 6, 8, 9 (10 is an error, 11's KL is NaN, 12 has the same bytes as 9)
    assert best_at(rows, 8.0) == (8, 4)
    head, at4, at8 = closing_lines(rows, INFO)
    assert "tiny-model" in head and "lowest KL" in head and "3.2x-5x" in head
    assert at4 == f"  about 4x: #3 {LONG_A} (3.66x, KL 0.0004)"
    assert at8 == f"  about 8x: #9 {LONGEST} (6.46x, KL 0.0800)"
    lines = render(rows, 120)
    assert lines[-2:] == [at4, at8]


def test_the_closing_lines_say_when_no_row_is_near_a_point():
    rows = [row("fp16", FP16, 0.0), row("uniform:bits=4", 1600, 0.03)]
    _, at4, at8 = closing_lines(rows, INFO)
    assert at4.startswith("  about 4x: #2 uniform:bits=4 ")
    assert at8 == "  about 8x: no row measured 6.4x-10x fewer held bytes than fp16"


def test_a_lossy_row_below_fp16s_perplexity_gets_a_noise_note():
    """A lossy cache cannot predict better than fp16: a row whose perplexity reads lower is
    marked as sample noise, with fp16's own band over the scored tokens (two standard errors of
    its mean token loss); none when no row is below fp16's."""
    from velox_cli.report import ppl_noise

    rows = crafted()
    for r, ppl in zip(rows, (4.7, 4.6, 4.8, 4.69), strict=False):
        r.ppl = ppl
    info = {**INFO, "fp16_ppl": 4.7, "fp16_nll_se": 0.05, "scored_tokens": 32}
    note = ppl_noise(rows, info)
    assert note.startswith("ppl: #2, #4 print a lower perplexity than fp16's 4.700"), note
    assert "32 scored tokens" in note and "+-11%" in note and "sample noise" in note
    printed = "\n".join(render(rows, 200, info))
    assert "sample noise" in printed
    for r in rows:
        r.ppl = 5.0
    assert ppl_noise(rows, info) == ""
