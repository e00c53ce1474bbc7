"""No import cycle inside velox-core or any method package, and no run-time source that
imports the test aids (velox-testing, pytest).

Every import counts, at module level, inside a function (a lazy import hides a cycle, it
does not remove it) or under ``if TYPE_CHECKING:`` (a type-only import is still a module that
needs the other to be read). ``from X import name`` depends on the submodule ``X.name`` where
there is one, else on ``X``.
"""

import ast
from pathlib import Path

import pytest

PACKAGES = sorted(
    p for p in (Path(__file__).parents[1] / "packages").iterdir() if (p / "src").is_dir()
)


def _modules(src: Path) -> dict[str, Path]:
    out = {}
    for f in src.rglob("*.py"):
        parts = f.relative_to(src).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = f
    return out


def _graph(src: Path) -> dict[str, set[str]]:
    mods = _modules(src)
    edges: dict[str, set[str]] = {m: set() for m in mods}
    for m, f in mods.items():
        tree = ast.parse(f.read_text(), str(f))
        here = m.split(".") if f.name == "__init__.py" else m.split(".")[:-1]
        for n in ast.walk(tree):
            if isinstance(n, ast.Import):
                targets = [a.name for a in n.names]
            elif isinstance(n, ast.ImportFrom):
                base = here[: len(here) - n.level + 1] if n.level else []
                mod = ".".join(base + ([n.module] if n.module else []))
                subs = [f"{mod}.{a.name}" for a in n.names]
                targets = [t for t in subs if t in mods]
                if len(targets) < len(subs):
                    targets.append(mod)
            else:
                continue
            edges[m] |= {t for t in targets if t in mods and t != m}
    return edges


def _cycle(edges: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(v: str) -> list[str] | None:
        state[v] = 1
        stack.append(v)
        for w in sorted(edges[v]):
            if state.get(w) == 1:
                return [*stack[stack.index(w) :], w]
            if w not in state and (found := visit(w)):
                return found
        stack.pop()
        state[v] = 2
        return None

    for v in sorted(edges):
        if v not in state and (found := visit(v)):
            return found
    return None


@pytest.mark.parametrize("package", PACKAGES, ids=lambda p: p.name)
def test_no_import_cycle(package):
    found = _cycle(_graph(package / "src"))
    assert found is None, "import cycle: " + " -> ".join(found)


def _demo(tmp_path: Path, files: dict[str, str]) -> Path:
    """A package ``demo`` in ``tmp_path / "src"`` of ``files`` (file name: source); returns
    its folder."""
    pkg = tmp_path / "src" / "demo"
    pkg.mkdir(parents=True)
    for name, text in files.items():
        (pkg / name).write_text(text)
    return pkg


def test_the_walk_finds_a_cycle(tmp_path):
    pkg = _demo(
        tmp_path,
        {
            "__init__.py": "",
            "a.py": "from .b import f\n",
            "b.py": "def f():\n    from . import a\n",
            "c.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .a import x\n",
        },
    )
    assert _cycle(_graph(tmp_path / "src")) == ["demo.a", "demo.b", "demo.a"]
    (pkg / "b.py").write_text("def f():\n    pass\n")
    assert _cycle(_graph(tmp_path / "src")) is None
    # a type-only import closes a cycle too
    (pkg / "b.py").write_text("from .c import g\n")
    assert _cycle(_graph(tmp_path / "src")) == ["demo.a", "demo.b", "demo.c", "demo.a"]


TEST_AIDS = ("velox_testing", "pytest")


def _test_aid_imports(src: Path) -> list[str]:
    """``file:line: module`` of each import of a test aid under ``src``."""
    found = []
    for f in sorted(src.rglob("*.py")):
        for n in ast.walk(ast.parse(f.read_text(), str(f))):
            if isinstance(n, ast.Import):
                names = [a.name for a in n.names]
            elif isinstance(n, ast.ImportFrom) and not n.level:
                names = [n.module or ""]
            else:
                continue
            for name in names:
                if name.split(".")[0] in TEST_AIDS:
                    found.append(f"{f.relative_to(src)}:{n.lineno}: {name}")
    return found


@pytest.mark.parametrize(
    "package", [p for p in PACKAGES if p.name != "velox-testing"], ids=lambda p: p.name
)
def test_run_time_sources_import_no_test_aid(package):
    """velox-core and the method packages need only their own dependencies at run time: the
    conformance suite, the tiny models and the kernel emulator are velox-testing's."""
    found = _test_aid_imports(package / "src")
    assert not found, "a test aid imported at run time:\n" + "\n".join(found)


def test_the_walk_finds_a_test_aid_import(tmp_path):
    _demo(
        tmp_path,
        {
            "a.py": "import os\nfrom velox_core import ops\n",
            "b.py": "def f():\n    from velox_testing.emulate import shim_dir\n",
            "c.py": "import pytest as pt\nfrom . import velox_testing\n",
        },
    )
    assert _test_aid_imports(tmp_path / "src") == [
        "demo/b.py:2: velox_testing.emulate",
        "demo/c.py:1: pytest",
    ]
