"""README's methods table carries a column "Gemma 3: 4x / 8x": it must be what
``benchmarks/longctx_best.py --readme README.md`` writes from the runs that docs/long-context.md
gathers (the command is read from that page, as a reader's shell expands it), and
``readme_column`` rewrites that column alone."""

import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SECTION = "### Every method's best setting at 4x, 8x and 16x"
PREFIX = "cd docs/data && python ../../benchmarks/longctx_best.py "


@pytest.fixture(scope="module")
def best(load_benchmark):
    return load_benchmark("longctx_best")


def _documented_args() -> list[str]:
    """The arguments of the command in docs/long-context.md's section :data:`SECTION`, its
    globs and braces expanded by bash in docs/data (where the command runs)."""
    text = (ROOT / "docs" / "long-context.md").read_text()
    assert SECTION in text, f"docs/long-context.md has no section {SECTION!r}"
    block = re.search(r"```bash\n(.*?)```", text[text.index(SECTION) :], re.S)
    assert block is not None, f"no bash block under {SECTION!r}"
    command = block[1].replace("\\\n", " ").strip()
    assert command.startswith(PREFIX) and "\n" not in command, command
    words = subprocess.run(
        ["bash", "-c", f"printf '%s\\0' {command[len(PREFIX) :]}"],
        cwd=ROOT / "docs" / "data",
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return words.split("\0")[:-1]


def _column(best, text: str) -> dict[str, str]:
    """README's column by method."""
    lines = text.split("\n")
    head = next(i for i, line in enumerate(lines) if best.README_COLUMN in line)
    names = best._cells(lines[head])
    at, method = names.index(best.README_COLUMN), names.index("method")
    out = {}
    for line in lines[head + 2 :]:
        if not line.startswith("|"):
            break
        cells = best._cells(line)
        out[cells[method].strip("`")] = cells[at]
    return out


def test_readmes_column_is_what_the_documented_command_writes(best, tmp_path, monkeypatch, capsys):
    args = _documented_args()
    runs = [a for a in args if a.endswith(".json")]
    assert len(runs) >= 5 and "eval-h100-gemma3-inside-96.json" in runs
    written = tmp_path / "README.md"
    shutil.copy(ROOT / "README.md", written)
    monkeypatch.chdir(ROOT / "docs" / "data")
    assert best.main([*args, "--readme", str(written)]) == 0
    capsys.readouterr()  # the full table, printed as well
    readme, want = (ROOT / "README.md").read_text(), written.read_text()
    have, got = _column(best, readme), _column(best, want)
    assert len(have) >= 40 and set(have) == set(got)
    wrong = {m: (have[m], got[m]) for m in have if have[m] != got[m]}
    assert not wrong, f"README's column differs from the data (README, data): {wrong}"
    assert readme == want  # and nothing else of README changes


def _entry(best, spec: str, ratio: float, delta: float, question: str = "after"):
    return best.Entry(best.method_of(spec), spec, ratio, delta, 0.02, delta, 48, question, "r")


def test_readme_column_rewrites_that_column_alone(best):
    rows = [
        _entry(best, "kivi:bits=4", 3.5, -0.03),
        _entry(best, "snapkv:budget=25%", 4.0, 0.01, "inside"),
        _entry(best, "snapkv:budget=12.5%", 7.8, -0.2, "inside"),
        _entry(best, "snapkv:budget=50%+uniform:bits=4", 7.0, -0.5),  # not in the table
        _entry(best, "tova:budget=6.25%", 15.0, -0.9),  # 16x: not in the column
    ]
    text = "\n".join(
        [
            "# title | not a table",
            "",
            f"| package | method | what it does | {best.README_COLUMN} |",
            "|---|---|---|---|",
            "| velox-kivi | `kivi` | keys per channel | old |",
            "| velox-snapkv | `snapkv` | votes |  |",
            "| velox-tova | `tova` | last query | +5 / +5 |",
            "| velox-qjl | `qjl` | sketches | - |",
            "",
            "| method | other |",
            "|---|---|",
            "| `kivi` | kept |",
            "",
        ]
    )
    out = best.readme_column(text, best.best(rows)).split("\n")
    assert out[:4] == text.split("\n")[:4] and out[8:] == text.split("\n")[8:]
    assert out[4] == "| velox-kivi | `kivi` | keys per channel | -3 / - |"
    assert out[5] == "| velox-snapkv | `snapkv` | votes | +1 (i) / -20 (i) |"
    assert out[6] == "| velox-tova | `tova` | last query | - |"
    assert out[7] == "| velox-qjl | `qjl` | sketches | - |"
    table = best.best(rows)
    with pytest.raises(ValueError, match="no Markdown table with the columns"):
        best.readme_column("| method | x |\n|---|---|\n", table)
    with pytest.raises(ValueError, match="line 3: 2 cells where the table's head has 3"):
        best.readme_column(
            f"| a | method | {best.README_COLUMN} |\n|---|---|---|\n| b | c |", table
        )
    with pytest.raises(ValueError, match=r"line 2: the table's head is not followed"):
        best.readme_column(f"| method | {best.README_COLUMN} |\n| `kivi` | x |", table)
    with pytest.raises(ValueError, match="points among 4x, 8x, 16x"):
        best.readme_column(text, table, column="Gemma 3: 4x / 32x")
