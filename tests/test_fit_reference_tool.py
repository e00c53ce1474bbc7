"""tools/fit_reference.py: one command line for every method's reference artifact."""

import importlib
import inspect
import sys
from pathlib import Path

import pytest

TOOLS = Path(__file__).resolve().parents[1] / "tools"


@pytest.fixture(scope="module")
def tool(load_tool):
    sys.path.insert(0, str(TOOLS))  # its import of reference_calibration
    try:
        yield load_tool("fit_reference")
    finally:
        sys.path.remove(str(TOOLS))


def test_every_method_names_its_package_fit_and_save(tool):
    assert sorted(tool.METHODS) == [
        "cachegen",
        "commvq",
        "kvtc",
        "oscar",
        "palu",
        "qfilters",
        "spectral",
    ]
    for name, m in tool.METHODS.items():
        mod = importlib.import_module(f"velox_{name}")
        params = inspect.signature(getattr(mod, m.fit)).parameters
        assert callable(getattr(mod, m.save))
        for option in m.options:
            assert option.name in params, (name, option.name)
        assert ("seed" in params) >= m.seeded


def test_defaults_and_method_options(tool):
    args = tool.parser().parse_args(["kvtc"])
    assert (args.tokens, args.per_file, args.seed) == (32768, 1024, 0)
    assert args.ratios == [16.0, 20.0, 24.0, 32.0]
    assert args.out.endswith("shared/artifacts/kvtc-reference-model.safetensors")
    args = tool.parser().parse_args(["qfilters", "--samples", "64", "--out", "x.safetensors"])
    assert (args.tokens, args.per_file, args.samples, args.out) == (4096, 512, 64, "x.safetensors")
    args = tool.parser().parse_args(["spectral"])
    assert (args.skip, args.positions) == (None, None)  # not passed: the fit's defaults hold
    with pytest.raises(SystemExit):
        tool.parser().parse_args(["uniform"])
    with pytest.raises(SystemExit):
        tool.parser().parse_args(["oscar", "--ratios", "16"])
