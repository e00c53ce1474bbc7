"""No import cycle inside velox-core or any method package.

Every import counts, at module level or inside a function (a lazy import hides a cycle, it
does not remove it), except those under ``if TYPE_CHECKING:``. ``from X import name`` depends
on the submodule ``X.name`` where there is one, else on ``X``.
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
        skip = set()
        for n in ast.walk(tree):
            if isinstance(n, ast.If) and "TYPE_CHECKING" in ast.unparse(n.test):
                skip |= {id(x) for b in n.body for x in ast.walk(b)}
        here = m.split(".") if f.name == "__init__.py" else m.split(".")[:-1]
        for n in ast.walk(tree):
            if id(n) in skip:
                continue
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


def test_the_walk_finds_a_cycle(tmp_path):
    pkg = tmp_path / "src" / "demo"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from .b import f\n")
    (pkg / "b.py").write_text("def f():\n    from . import a\n")
    (pkg / "c.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .a import x\n"
    )
    assert _cycle(_graph(tmp_path / "src")) == ["demo.a", "demo.b", "demo.a"]
    (pkg / "b.py").write_text("def f():\n    pass\n")
    assert _cycle(_graph(tmp_path / "src")) is None
