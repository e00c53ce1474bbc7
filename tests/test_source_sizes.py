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


# the methods whose code layouts (records, checks, kernels) live in their own packages
# (issue: one package per method, kernels included): velox-core's source names none of them
OWN_LAYOUTS = ("qjl", "vecinfer", "commvq", "turboquant")


def test_core_source_names_no_method_with_a_layout_of_its_own():
    files = sorted(ROOT.glob("packages/velox-core/src/**/*.py"))
    assert len(files) > 50
    found = {
        f"{f.relative_to(ROOT)}:{i}": name
        for f in files
        for i, line in enumerate(f.read_text().lower().splitlines(), 1)
        for name in OWN_LAYOUTS
        if name in line
    }
    assert not found, f"velox-core names a method package: {found}"
