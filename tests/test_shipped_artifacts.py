"""Every artifact that ships in ``shared/artifacts`` loads with its method's reader, holds
exactly the file's arrays, and is written back by its method's writer to the same bytes: the
file format of each fitted artifact is what these files are."""

from __future__ import annotations

import importlib
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from velox_core.artifacts import read_metadata

ROOT = Path(__file__).resolve().parents[1]
SHIPPED = sorted(
    p
    for d in (ROOT / "shared" / "artifacts", ROOT.parent / "velox-shared-aside" / "artifacts")
    if d.is_dir()
    for p in d.glob("*.safetensors")
)
# format -> (module, reader, writer)
METHODS = {
    "velox-cachegen": ("velox_cachegen", "load_profile", "save_profile"),
    "velox-commvq": ("velox_commvq", "load_codebooks", "save_codebooks"),
    "velox-kvtc": ("velox_kvtc", "load_basis", "save_basis"),
    "velox-oscar": ("velox_oscar", "load_rotations", "save_rotations"),
    "velox-palu": ("velox_palu", "load_bases", "save_bases"),
    "velox-qfilters": ("velox_qfilters", "load_filters", "save_filters"),
    "velox-spectral": ("velox_spectral", "load_bases", "save_bases"),
}


def _arrays(record) -> list:
    """Every array a record holds (MLX or NumPy; in its fields, dicts, lists and tuples)."""
    out, todo = [], [record]
    while todo:
        x = todo.pop()
        if isinstance(x, (mx.array, np.ndarray)):
            out.append(x)
        elif isinstance(x, dict):
            todo.extend(x.values())
        elif isinstance(x, (list, tuple)):
            todo.extend(x)
        elif hasattr(x, "__dataclass_fields__"):
            todo.extend(getattr(x, f) for f in x.__dataclass_fields__)
    return out


def _key(a) -> tuple:
    if isinstance(a, mx.array) and a.dtype == mx.bfloat16:
        a = a.astype(mx.float32)
    a = np.asarray(a)
    return a.dtype.str, a.shape, a.tobytes()


@pytest.mark.skipif(not SHIPPED, reason="no shared/artifacts in this checkout")
@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.name)
def test_a_shipped_artifact_loads_as_its_file_and_saves_to_the_same_bytes(path, tmp_path):
    module, reader, writer = METHODS[read_metadata(path)["format"]]
    mod = importlib.import_module(module)
    record = getattr(mod, reader)(path)
    held = sorted(_key(a) for a in _arrays(record))
    if module != "velox_cachegen":  # its steps are kept as Python floats, not arrays
        assert held == sorted(_key(a) for a in mx.load(str(path)).values())
    again = getattr(mod, writer)(record, tmp_path / path.name)
    assert again.read_bytes() == path.read_bytes()
