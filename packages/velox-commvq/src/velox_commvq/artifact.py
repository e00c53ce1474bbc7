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

from dataclasses import dataclass
from typing import Any

import mlx.core as mx

from velox_core.artifacts import ArtifactFile, ArtifactKind, FittedLayers, search_dirs

from .vq import Geometry

__all__ = [
    "FORMAT",
    "Codebooks",
    "MissingCodebooksError",
    "find_codebooks",
    "load_cached",
    "load_codebooks",
    "resolve_codebooks",
    "save_codebooks",
    "search_dirs",
]


@dataclass
class Codebooks(FittedLayers):
    """Fitted CommVQ key codebooks of one model (``fingerprint``, ``model``, ``calibration``
    and ``layer(i)``: :class:`~velox_core.artifacts.FittedLayers`).

    Attributes:
        layers: layer index -> ``(a, b)``, each ``(H_kv, S, P, K, 2)``; pair ``p`` of stage
            ``s`` codes as ``a[h, s, p, c1] + J b[h, s, p, c2]``.
        layouts: layer index -> ``[dims, traditional]`` of the RoPE it was fitted under.
        pairs: RoPE pairs sharing one code per stage (``G``).
    """

    what = "CommVQ codebooks"
    noun = "codebooks"
    layers: dict[int, tuple[mx.array, mx.array]]
    layouts: dict[int, list[int]]
    pairs: int

    @property
    def geometry(self) -> Geometry:
        a = next(iter(self.layers.values()))[0]
        return Geometry(self.pairs, int(a.shape[3]), int(a.shape[1]))

    def check(self, where: str) -> None:
        """``ValueError`` naming ``where`` unless every layer is two ``(H, S, P, K, 2)`` arrays
        with a layout and a consistent geometry (``P`` a multiple of the pairs, ``K`` a power
        of two >= 2)."""
        for i, (a, b) in self.layers.items():
            if a.ndim != 5 or a.shape != b.shape or a.shape[-1] != 2 or i not in self.layouts:
                raise ValueError(
                    f"{where}: layer {i} is not two (H, S, P, K, 2) arrays with a layout"
                )
            if a.shape[2] % self.pairs or a.shape[3] & (a.shape[3] - 1) or a.shape[3] < 2:
                raise ValueError(
                    f"{where}: layer {i} has an inconsistent geometry {tuple(a.shape)}"
                )

    def encode(self) -> tuple[dict[str, mx.array], dict[str, Any]]:
        arrays = {
            f"layer.{i}.{name}": x.astype(mx.float16)
            for i, pair in self.layers.items()
            for name, x in zip("ab", pair)
        }
        return arrays, {"layouts": self.layouts, "pairs": str(self.pairs)}

    @classmethod
    def decode(cls, f: ArtifactFile) -> Codebooks:
        layers = {i: (f.arrays[f"layer.{i}.a"], f.arrays[f"layer.{i}.b"]) for i in f.layers}
        return cls(layers, f.per_layer("layouts", int), int(f.meta["pairs"]), **f.provenance())


class MissingCodebooksError(FileNotFoundError):
    """No CommVQ artifact was found for a model."""


KIND = ArtifactKind(
    "velox-commvq", "1", "CommVQ", "codebooks", missing=MissingCodebooksError, record=Codebooks
)
FORMAT, VERSION, HOW_TO_FIT = KIND.fmt, KIND.version, KIND.how_to_fit
# save_codebooks(books, path); load_codebooks(path) (ValueError if it is not one, or an
# inconsistent one); load_cached(path) (read once per file version: every layer's cache shares
# it); find_codebooks(fp, dirs=None): the first CommVQ artifact fitted for fingerprint ``fp``;
# resolve_codebooks(model, path=None): the one to use for ``model`` (``path`` if given, checked;
# MissingCodebooksError where none is found): :class:`~velox_core.artifacts.ArtifactKind`.
save_codebooks, load_codebooks, load_cached = KIND.save, KIND.load, KIND.load_cached
find_codebooks, resolve_codebooks = KIND.find, KIND.resolve
