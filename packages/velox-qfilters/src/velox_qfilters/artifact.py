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

from velox_core.artifacts import ArtifactFile, ArtifactKind, FittedLayers, search_dirs
from velox_core.artifacts import load_cached as _load_cached

__all__ = [
    "FORMAT",
    "Filters",
    "MissingFiltersError",
    "find_filters",
    "load_filters",
    "resolve_filters",
    "save_filters",
    "search_dirs",
]


@dataclass
class Filters(FittedLayers):
    """Fitted Q-Filters of one model: ``layers`` maps layer index -> float32 ``(H_kv, D)``
    filter of each KV head (``fingerprint``, ``model`` and ``calibration``: how they were
    fitted; ``layer(i)``: :class:`~velox_core.artifacts.FittedLayers`)."""

    what = "Q-Filters"
    layers: dict[int, mx.array]
    fingerprint: str
    model: dict[str, Any] = field(default_factory=dict)
    calibration: dict[str, Any] = field(default_factory=dict)


class MissingFiltersError(FileNotFoundError):
    """No Q-Filters artifact was found for a model."""


HOW_TO_FIT = "python -m velox_qfilters fit --model PATH --text CALIBRATION.txt --out FILE"
KIND = ArtifactKind("velox-qfilters", "1", "Q-Filters", "filters", HOW_TO_FIT, MissingFiltersError)
FORMAT, VERSION = KIND.fmt, KIND.version


def save_filters(filters: Filters, path: str | os.PathLike) -> Path:
    """Write ``filters`` to ``path`` (``.safetensors``; parent directories are created)."""
    arrays = {}
    for i, f in filters.layers.items():
        if f.ndim != 2:
            raise ValueError(f"save_filters: layer {i} must be (H_kv, D), got {tuple(f.shape)}")
        arrays[f"layer.{i}"] = f.astype(mx.float32)
    return KIND.write(path, arrays, list(filters.layers), filters.provenance(), "save_filters")


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


# find_filters(fp, dirs=None): the first Q-Filters artifact fitted for fingerprint ``fp``;
# resolve_filters(model, path=None): the one to use for ``model`` (``path`` if given, checked;
# MissingFiltersError where none is found): :class:`~velox_core.artifacts.ArtifactKind`.
find_filters, resolve_filters = KIND.find, KIND.resolve
