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

from dataclasses import dataclass
from typing import Any

import mlx.core as mx

from velox_core.artifacts import ArtifactFile, ArtifactKind, FittedLayers, search_dirs

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
    noun = "filters"
    layers: dict[int, mx.array]

    def check(self, where: str) -> None:
        """``ValueError`` naming ``where`` unless every layer is an ``(H_kv, D)`` array."""
        for i, f in self.layers.items():
            if f.ndim != 2:
                raise ValueError(f"{where}: layer {i} must be (H_kv, D), got {tuple(f.shape)}")

    def encode(self) -> tuple[dict[str, mx.array], dict[str, Any]]:
        return {f"layer.{i}": f.astype(mx.float32) for i, f in self.layers.items()}, {}

    @classmethod
    def decode(cls, f: ArtifactFile) -> Filters:
        layers = {i: f.arrays[f"layer.{i}"] for i in f.layers}
        for i, a in layers.items():
            if a.dtype != mx.float32:
                raise ValueError(f"layer {i} is not a float32 array")
        return cls(layers, **f.provenance())


class MissingFiltersError(FileNotFoundError):
    """No Q-Filters artifact was found for a model."""


KIND = ArtifactKind(
    "velox-qfilters", "1", "Q-Filters", "filters", missing=MissingFiltersError, record=Filters
)
FORMAT, VERSION, HOW_TO_FIT = KIND.fmt, KIND.version, KIND.how_to_fit
# save_filters(filters, path); load_filters(path) (ValueError if it is not one, or an
# inconsistent one); load_cached(path) (read once per file version: every layer's cache shares
# it); find_filters(fp, dirs=None): the first Q-Filters artifact fitted for fingerprint ``fp``;
# resolve_filters(model, path=None): the one to use for ``model`` (``path`` if given, checked;
# MissingFiltersError where none is found): :class:`~velox_core.artifacts.ArtifactKind`.
save_filters, load_filters, load_cached = KIND.save, KIND.load, KIND.load_cached
find_filters, resolve_filters = KIND.find, KIND.resolve
