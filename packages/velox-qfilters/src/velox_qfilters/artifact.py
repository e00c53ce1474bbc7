"""Q-Filters artifacts: the fitted filters of one model, in a safetensors file.

A file holds one ``(H_kv, D)`` float32 array per attention layer (``layer.<i>``) and, in the
safetensors metadata, ``format="velox-qfilters"``, a version, the model's
:func:`velox_core.artifacts.fingerprint`, its identifying config and how the filters
were fitted. The cache finds the file of a model by that fingerprint
(:func:`resolve_filters`): an explicit path wins; otherwise the directories of
``$VELOX_ARTIFACTS`` (colon-separated) and then ``~/.cache/velox`` are searched.

Deviation from the paper: the authors publish filters on the Hugging Face Hub under the
model's name; velox keeps them in a local file matched to the model by its weights.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import mlx.core as mx

from velox_core.artifacts import ENV, ArtifactFile, ArtifactKind, read_metadata, search_dirs
from velox_core.artifacts import load_cached as _load_cached

__all__ = [
    "ENV",
    "FORMAT",
    "Filters",
    "MissingFiltersError",
    "find_filters",
    "load_filters",
    "read_metadata",
    "resolve_filters",
    "save_filters",
    "search_dirs",
]

FORMAT = "velox-qfilters"
VERSION = "1"
HOW_TO_FIT = "python -m velox_qfilters fit --model PATH --text CALIBRATION.txt --out FILE"


class MissingFiltersError(FileNotFoundError):
    """No Q-Filters artifact was found for a model."""


KIND = ArtifactKind(FORMAT, VERSION, "Q-Filters", "filters", HOW_TO_FIT, MissingFiltersError)


@dataclass
class Filters:
    """Fitted Q-Filters of one model.

    Attributes:
        layers: layer index -> float32 ``(H_kv, D)`` filter of each KV head.
        fingerprint: the model's fingerprint (:func:`velox_core.artifacts.fingerprint`).
        model: the model's identifying config (model type, heads, head dim, RoPE...).
        calibration: how the filters were fitted (tokens, samples, seed, source...).
    """

    layers: dict[int, mx.array]
    fingerprint: str
    model: dict[str, Any] = field(default_factory=dict)
    calibration: dict[str, Any] = field(default_factory=dict)

    def layer(self, i: int) -> mx.array:
        """The ``(H_kv, D)`` filters of layer ``i``."""
        if i not in self.layers:
            raise ValueError(
                f"these Q-Filters have no layer {i} (fitted layers: {sorted(self.layers)})"
            )
        return self.layers[i]


def save_filters(filters: Filters, path: str | os.PathLike) -> Path:
    """Write ``filters`` to ``path`` (``.safetensors``; parent directories are created)."""
    arrays = {}
    for i, f in filters.layers.items():
        if f.ndim != 2:
            raise ValueError(f"save_filters: layer {i} must be (H_kv, D), got {tuple(f.shape)}")
        arrays[f"layer.{i}"] = f.astype(mx.float32)
    meta = {
        "fingerprint": filters.fingerprint,
        "model": filters.model,
        "calibration": filters.calibration,
    }
    return KIND.write(path, arrays, list(filters.layers), meta, "save_filters")


def _filters(f: ArtifactFile) -> Filters:
    return Filters({i: f.arrays[f"layer.{i}"] for i in f.layers}, **f.provenance())


def load_filters(path: str | os.PathLike) -> Filters:
    """Read a file written by :func:`save_filters` (``ValueError`` if it is not one)."""
    out = KIND.read(path, _filters)
    for i, f in out.layers.items():
        if f.ndim != 2 or f.dtype != mx.float32:
            raise ValueError(f"{path}: layer {i} is not a float32 (H_kv, D) array")
    return out


def load_cached(path: str | os.PathLike) -> Filters:
    """:func:`load_filters`, read once per file version (every layer's cache shares it)."""
    return _load_cached(load_filters, path)


def find_filters(fp: str, dirs: list[Path] | None = None) -> Path | None:
    """The first artifact (directories in order, files sorted by name) fitted for ``fp``."""
    return KIND.find(fp, dirs)


def resolve_filters(model: Any, filters: str | os.PathLike | None = None) -> Path:
    """The artifact to use for ``model``: ``filters`` if given (checked), else the lookup.

    Raises:
        ValueError: ``filters`` is not a Q-Filters artifact or was fitted for another model.
        MissingFiltersError: nothing in the search directories was fitted for this model.
    """
    return KIND.resolve(model, filters)
