"""velox-core's public face stays small: at most ``LIMIT`` names in its ``__all__`` lists, each
exported by one module only (tools/public_names.py counts them)."""

import importlib
import sys

import pytest

LIMIT = 200


@pytest.fixture(scope="module")
def tool(load_tool):
    return load_tool("public_names")


def test_public_names_within_limit(tool):
    names = tool.public_names()
    total = sum(len(v) for v in names.values())
    assert total <= LIMIT, f"{total} names in velox-core's __all__ lists (at most {LIMIT})"


def test_every_name_has_one_home(tool):
    assert tool.second_homes(tool.public_names()) == {}


def test_listed_names_exist(tool):
    for module, listed in tool.public_names().items():
        mod = importlib.import_module(module)
        missing = [n for n in listed if not hasattr(mod, n)]
        assert not missing, f"{module}.__all__ lists names it does not define: {missing}"
        assert len(set(listed)) == len(listed), f"{module}.__all__ repeats a name"


def test_the_count_reads_computed_lists(tmp_path, tool):
    """A list built at import time counts with its real length."""
    pkg = tmp_path / "face_probe"
    pkg.mkdir()
    (pkg / "__init__.py").write_text('__all__ = ["a"]\na = 1\n')
    (pkg / "b.py").write_text('_x = ["c", "d"]\n__all__ = [*_x, "e"]\nc = d = e = 2\n')
    (pkg / "c.py").write_text("f = 3\n")
    sys.path.insert(0, str(tmp_path))
    try:
        names = tool.public_names(tmp_path)
    finally:
        sys.path.remove(str(tmp_path))
    assert names == {"face_probe": ["a"], "face_probe.b": ["c", "d", "e"]}
