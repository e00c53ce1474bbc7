"""CommVQ artifacts: the fitted key codebooks of one model, in a safetensors file.

A file holds, per attention layer ``i``, ``layer.<i>.a`` and ``layer.<i>.b``: float16
``(H_kv, S, P, K, 2)`` codebooks (:mod:`velox_commvq.vq`), and in its metadata
``format="velox-commvq"``, a version, the model's fingerprint
(:func:`velox_core.artifacts.fingerprint`) and identifying config, the pairs per code ``G``, each
layer's RoPE pair layout ``[dims, traditional]`` and how the codebooks were fitted. A cache
finds the file of its model by that fingerprint (:func:`resolve_codebooks`): an explicit path
wins; otherwise the directories of ``$VELOX_ARTIFACTS`` (colon-separated), then
``~/.cache/velox``. A model without one is an error, never a random codebook.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import mlx.core as mx

from velox_core.artifacts import (
    ENV,
    check_format,
    find_artifact,
    read_metadata,
    resolve_artifact,
    search_dirs,
)
from velox_core.artifacts import load_cached as _load_cached

from .vq import Geometry

__all__ = [
    "ENV",
    "FORMAT",
    "Codebooks",
    "MissingCodebooksError",
    "find_codebooks",
    "load_cached",
    "load_codebooks",
    "read_metadata",
    "resolve_codebooks",
    "save_codebooks",
    "search_dirs",
]

FORMAT = "velox-commvq"
VERSION = "1"
HOW_TO_FIT = "python -m velox_commvq fit --model PATH --text CALIBRATION.txt --out FILE"


class MissingCodebooksError(FileNotFoundError):
    """No CommVQ artifact was found for a model."""


@dataclass
class Codebooks:
    """Fitted CommVQ key codebooks of one model.

    Attributes:
        layers: layer index -> ``(a, b)``, each ``(H_kv, S, P, K, 2)``; pair ``p`` of stage
            ``s`` codes as ``a[h, s, p, c1] + J b[h, s, p, c2]``.
        layouts: layer index -> ``[dims, traditional]`` of the RoPE it was fitted under.
        pairs: RoPE pairs sharing one code per stage (``G``).
        fingerprint: the model's fingerprint.
        model: the model's identifying config.
        calibration: how the codebooks were fitted.
    """

    layers: dict[int, tuple[mx.array, mx.array]]
    layouts: dict[int, list[int]]
    pairs: int
    fingerprint: str
    model: dict[str, Any] = field(default_factory=dict)
    calibration: dict[str, Any] = field(default_factory=dict)

    def layer(self, i: int) -> tuple[mx.array, mx.array]:
        if i not in self.layers:
            raise ValueError(
                f"these CommVQ codebooks have no layer {i} (fitted: {sorted(self.layers)})"
            )
        return self.layers[i]

    @property
    def geometry(self) -> Geometry:
        a = next(iter(self.layers.values()))[0]
        return Geometry(self.pairs, int(a.shape[3]), int(a.shape[1]))


def save_codebooks(books: Codebooks, path: str | os.PathLike) -> Path:
    """Write ``books`` to ``path`` (``.safetensors``; parent directories are created)."""
    path = Path(path).expanduser()
    if path.suffix != ".safetensors":
        raise ValueError(f"save_codebooks: the file name must end in .safetensors, got {path}")
    if not books.layers:
        raise ValueError("save_codebooks: no layers to save")
    arrays = {}
    for i, (a, b) in books.layers.items():
        if a.ndim != 5 or a.shape != b.shape or a.shape[-1] != 2:
            raise ValueError(f"save_codebooks: layer {i} must be two (H, S, P, K, 2) arrays")
        arrays[f"layer.{i}.a"], arrays[f"layer.{i}.b"] = a.astype(mx.float16), b.astype(mx.float16)
    meta = {
        "format": FORMAT,
        "version": VERSION,
        "fingerprint": books.fingerprint,
        "layers": json.dumps(sorted(books.layers)),
        "layouts": json.dumps({str(i): v for i, v in sorted(books.layouts.items())}),
        "pairs": str(books.pairs),
        "model": json.dumps(books.model, sort_keys=True),
        "calibration": json.dumps(books.calibration, sort_keys=True),
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(path), arrays, meta)
    return path


def load_codebooks(path: str | os.PathLike) -> Codebooks:
    """Read a file written by :func:`save_codebooks` (``ValueError`` if it is not one)."""
    path = Path(path).expanduser()
    meta = read_metadata(path)
    check_format(path, meta, FORMAT, VERSION, "CommVQ")
    try:
        arrays = mx.load(str(path))
        ids = [int(i) for i in json.loads(meta["layers"])]
        layers = {i: (arrays[f"layer.{i}.a"], arrays[f"layer.{i}.b"]) for i in ids}
        layouts = {int(i): [int(x) for x in v] for i, v in json.loads(meta["layouts"]).items()}
        out = Codebooks(
            layers,
            layouts,
            int(meta["pairs"]),
            meta["fingerprint"],
            json.loads(meta["model"]),
            json.loads(meta["calibration"]),
        )
    except (KeyError, TypeError, ValueError, RuntimeError) as e:
        raise ValueError(f"{path}: corrupt CommVQ artifact ({e})") from None
    for i, (a, b) in out.layers.items():
        if a.ndim != 5 or a.shape != b.shape or a.shape[-1] != 2 or i not in out.layouts:
            raise ValueError(f"{path}: layer {i} is not two (H, S, P, K, 2) arrays with a layout")
        if a.shape[2] % out.pairs or a.shape[3] & (a.shape[3] - 1) or a.shape[3] < 2:
            raise ValueError(f"{path}: layer {i} has an inconsistent geometry {tuple(a.shape)}")
    return out


def load_cached(path: str | os.PathLike) -> Codebooks:
    """:func:`load_codebooks`, read once per file version (every layer's cache shares it)."""
    return _load_cached(load_codebooks, path)


def find_codebooks(fp: str, dirs: list[Path] | None = None) -> Path | None:
    """The first artifact (directories in order, files sorted by name) fitted for ``fp``."""
    return find_artifact(FORMAT, fp, dirs, VERSION)


def resolve_codebooks(model: Any, codebooks: str | os.PathLike | None = None) -> Path:
    """The artifact to use for ``model``: ``codebooks`` if given (checked), else the lookup.

    Raises:
        ValueError: ``codebooks`` is not a CommVQ artifact or was fitted for another model.
        MissingCodebooksError: nothing in the search directories was fitted for this model.
    """
    return resolve_artifact(
        model,
        codebooks,
        fmt=FORMAT,
        version=VERSION,
        what="CommVQ",
        how_to_fit=HOW_TO_FIT,
        param="codebooks",
        missing=MissingCodebooksError,
    )
