"""No source file of a package over 500 lines (issue: a cache a reader can follow): a module
that grows past it is split by what it does, not left to grow."""

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LIMIT = 500


def test_no_package_source_file_over_500_lines():
    files = sorted(ROOT.glob("packages/*/src/**/*.py"))
    assert len(files) > 100  # the packages are there
    over = {
        str(f.relative_to(ROOT)): n for f in files if (n := len(f.read_text().splitlines())) > LIMIT
    }
    assert not over, f"over {LIMIT} lines: {over}"
