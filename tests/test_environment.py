"""``VELOX_*`` environment variables are read in two modules only: the kernels' configuration
(:mod:`velox_core.kernels.config`) and :mod:`velox_core.environment`. This walks every
package's sources for reads of ``os.environ`` / ``os.getenv`` with a ``VELOX_`` name (a
literal, or a module constant holding one) anywhere else."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from velox_core import environment
from velox_core.kernels.config import ENVIRONMENT

ROOT = Path(__file__).resolve().parents[1]
ALLOWED = {
    ROOT / "packages/velox-core/src/velox_core/environment.py",
    ROOT / "packages/velox-core/src/velox_core/kernels/config.py",
}


def _is_environ(node: ast.AST) -> bool:
    return (
        isinstance(node, ast.Attribute)
        and node.attr == "environ"
        and isinstance(node.value, ast.Name)
        and node.value.id == "os"
    )


def velox_reads(source: str) -> list[tuple[int, str]]:
    """(line, name) of each ``VELOX_*`` environment read in ``source``."""
    tree = ast.parse(source)
    consts = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant):
            for t in node.targets:
                if isinstance(t, ast.Name) and isinstance(node.value.value, str):
                    consts[t.id] = node.value.value

    def name_of(node: ast.AST) -> str | None:
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            v = node.value
        elif isinstance(node, ast.Name):
            v = consts.get(node.id)
        else:
            return None
        return v if v and v.startswith("VELOX_") else None

    found = []
    for node in ast.walk(tree):
        key = None
        if isinstance(node, ast.Call) and node.args:
            f = node.func
            env_method = isinstance(f, ast.Attribute) and _is_environ(f.value)
            getenv = isinstance(f, ast.Attribute) and f.attr == "getenv"
            if env_method or getenv:
                key = name_of(node.args[0])
        elif isinstance(node, ast.Subscript) and _is_environ(node.value):
            key = name_of(node.slice)
        elif isinstance(node, ast.Compare) and any(_is_environ(c) for c in node.comparators):
            key = name_of(node.left)
        if key:
            found.append((node.lineno, key))
    return found


def test_the_walk_finds_each_kind_of_read():
    src = (
        "import os\nA = 'VELOX_X'\n"
        "os.environ.get('VELOX_A')\nos.environ['VELOX_B']\nos.getenv(A)\n"
        "'VELOX_C' in os.environ\nos.environ.get('HOME')\n"
    )
    assert velox_reads(src) == [(3, "VELOX_A"), (4, "VELOX_B"), (5, "VELOX_X"), (6, "VELOX_C")]


def test_no_velox_environment_read_outside_the_configuration_modules():
    offenders = []
    for path in sorted(ROOT.glob("packages/*/src/**/*.py")):
        if path in ALLOWED:
            continue
        for line, name in velox_reads(path.read_text()):
            offenders.append(f"{path.relative_to(ROOT)}:{line}: {name}")
    assert not offenders, "\n".join(offenders)


def test_environment_names_are_known_and_distinct_from_the_kernels():
    kernel_names = {name for name, _ in ENVIRONMENT.values()}
    assert not kernel_names & set(environment.NAMES)
    with pytest.raises(ValueError, match="unknown velox environment variable 'VELOX_NOPE'"):
        environment.get("VELOX_NOPE")


def test_environment_reads(monkeypatch, tmp_path):
    monkeypatch.setenv("VELOX_SHARED", f" {tmp_path}::~/x ")
    assert environment.paths("VELOX_SHARED") == [tmp_path, Path("~/x").expanduser()]
    monkeypatch.setenv("VELOX_BLAS", "   ")
    assert environment.get("VELOX_BLAS") is None
    env = environment.with_setting({"A": "1"}, VELOX_BLAS_ACTIVE="/lib.so")
    assert env == {"A": "1", "VELOX_BLAS_ACTIVE": "/lib.so"}
