"""Shared fixtures of the cross-package tests."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# velox serve's test helpers (packages/velox-cli/tests/serving.py) serve these tests too
sys.path.insert(0, str(ROOT / "packages" / "velox-cli" / "tests"))


def _loader(folder: str):
    """Import a script of ``folder`` by name, once (registered in ``sys.modules``: its
    dataclasses look their module up)."""

    def load(name: str):
        if name in sys.modules:
            return sys.modules[name]
        spec = importlib.util.spec_from_file_location(name, ROOT / folder / f"{name}.py")
        mod = importlib.util.module_from_spec(spec)
        sys.modules[name] = mod
        spec.loader.exec_module(mod)
        return mod

    return load


@pytest.fixture(scope="session")
def load_benchmark():
    """Import a script of ``benchmarks/`` by name (``load_benchmark("kernel_sass")``), once."""
    return _loader("benchmarks")


@pytest.fixture(scope="session")
def load_tool():
    """Import a script of ``tools/`` by name (``load_tool("public_names")``), once."""
    return _loader("tools")
