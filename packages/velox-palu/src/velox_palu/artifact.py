"""Palu artifacts: a model's fitted head-group bases of keys and values, in a safetensors file.

A file holds, per attention layer ``i`` and side ``s`` (``key``, ``value``):

* ``layer.<i>.<s>.basis``: float16 ``(G, gD, gD)``, for each of the ``G`` head groups (``g``
  KV heads each, ``D`` channels per head) the orthonormal right-singular vectors of the
  group's calibration outputs (pre-RoPE keys, or values; ``gD`` channels, heads in order),
  as columns sorted by singular value, largest first;
* ``layer.<i>.<s>.sigma``: float32 ``(G, gD)``, those singular values divided by
  ``sqrt(N)`` (``N`` calibration tokens): the RMS of each latent coordinate;
* ``layer.<i>.<s>.bias``: float32 ``(H, D)``, only where the projection has a bias (it is
  taken off before the fit and added back to every rebuilt vector, as Palu keeps the bias
  outside its low-rank factors).

Its metadata: ``format="velox-palu"``, a version, the model's fingerprint and identifying
config, ``g`` (``heads_per_group``), each layer's RoPE pair layout ``[dims, traditional]``,
the Fisher information of each layer's key and value projections (rank allocation,
:mod:`velox_palu.ranks`) and how it was fitted. Caches keep only the first ``r`` columns of
each basis; one artifact serves every rank.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import mlx.core as mx

from velox_core.artifacts import ArtifactFile, ArtifactKind, Fitted

__all__ = [
    "FORMAT",
    "HOW_TO_FIT",
    "SIDES",
    "MissingArtifactError",
    "PaluBases",
    "load_bases",
    "load_bases_cached",
    "resolve_bases",
    "save_bases",
]

FORMAT = "velox-palu"
VERSION = "1"
SIDES = ("key", "value")


class MissingArtifactError(FileNotFoundError):
    """No Palu artifact was found for a model."""


@dataclass
class PaluBases(Fitted):
    """Fitted Palu bases of one model (``fingerprint``, ``model`` and ``calibration``: how
    they were fitted, :class:`~velox_core.artifacts.Fitted`).

    Attributes:
        bases: ``(layer, side)`` -> ``(basis (G, gD, gD), sigma (G, gD))``.
        biases: ``(layer, side)`` -> ``(H, D)`` for projections with a bias.
        heads_per_group: KV heads per group ``g``.
        layouts: layer -> ``[dims, traditional]`` of the RoPE the keys were un-rotated with.
        fisher: layer -> ``[key, value]`` Fisher information of the projections (empty when
            fitted without it).
    """

    noun = "bases"
    bases: dict[tuple[int, str], tuple[mx.array, mx.array]]
    biases: dict[tuple[int, str], mx.array]
    heads_per_group: int
    layouts: dict[int, list[int]]
    fisher: dict[int, list[float]]

    @property
    def layers(self) -> list[int]:
        return sorted({i for i, _ in self.bases})

    def side(self, layer: int, side: str) -> tuple[mx.array, mx.array, mx.array | None]:
        """``(basis, sigma, bias or None)`` of one layer's keys or values."""
        if (layer, side) not in self.bases:
            raise ValueError(
                f"palu: this artifact has no layer {layer} (fitted: {self.layers}); it was "
                "fitted for another model"
            )
        basis, sigma = self.bases[(layer, side)]
        return basis, sigma, self.biases.get((layer, side))

    def check(self, where: str) -> None:
        """``ValueError`` naming ``where`` unless the bases, scales, biases, layouts and
        Fisher weights agree in shape and layers."""
        g = self.heads_per_group
        if not isinstance(g, int) or g < 1:
            raise ValueError(f"{where}: heads_per_group must be a positive int, got {g!r}")
        for (i, s), (basis, sigma) in self.bases.items():
            if s not in SIDES or basis.ndim != 3 or basis.shape[1] != basis.shape[2]:
                raise ValueError(f"{where}: layer {i} {s}: basis must be (G, gD, gD)")
            if sigma.shape != basis.shape[:2] or basis.shape[1] % g:
                raise ValueError(f"{where}: layer {i} {s}: sigma must be (G, gD) with gD % g == 0")
            bias = self.biases.get((i, s))
            h, d = basis.shape[0] * g, basis.shape[1] // g
            if bias is not None and tuple(bias.shape) != (h, d):
                raise ValueError(f"{where}: layer {i} {s}: bias must be (H, D) = {(h, d)}")
            if i not in self.layouts:
                raise ValueError(f"{where}: layer {i} has no RoPE layout")
        if self.fisher and set(self.fisher) != set(self.layers):
            raise ValueError(f"{where}: Fisher information must cover every layer or none")

    def encode(self) -> tuple[dict[str, mx.array], dict[str, Any]]:
        arrays = {}
        for (i, s), (basis, sigma) in self.bases.items():
            arrays[f"layer.{i}.{s}.basis"] = basis.astype(mx.float16)
            arrays[f"layer.{i}.{s}.sigma"] = sigma.astype(mx.float32)
        for (i, s), bias in self.biases.items():
            arrays[f"layer.{i}.{s}.bias"] = bias.astype(mx.float32)
        own = {"heads_per_group": str(self.heads_per_group), "layouts": self.layouts}
        return arrays, {**own, "fisher": self.fisher}

    @classmethod
    def decode(cls, f: ArtifactFile) -> PaluBases:
        bases, biases = {}, {}
        for i in f.layers:
            for s in SIDES:
                name = f"layer.{i}.{s}"
                bases[(i, s)] = (f.arrays[f"{name}.basis"], f.arrays[f"{name}.sigma"])
                if f"{name}.bias" in f.arrays:
                    biases[(i, s)] = f.arrays[f"{name}.bias"]
        g, layouts = int(f.meta["heads_per_group"]), f.per_layer("layouts", int)
        return cls(bases, biases, g, layouts, f.per_layer("fisher", float), **f.provenance())


KIND = ArtifactKind(
    FORMAT, VERSION, "Palu", "artifact", missing=MissingArtifactError, record=PaluBases
)
HOW_TO_FIT = KIND.how_to_fit
# save_bases(b, path) and load_bases(path) (ValueError if it is not one, or an inconsistent
# one), load_bases_cached(path) (read once per file version: every layer's cache shares it)
# and resolve_bases(model, path=None) (``path`` if given, checked; else found by the model's
# fingerprint; MissingArtifactError where none is): :class:`ArtifactKind`.
save_bases, load_bases, load_bases_cached = KIND.save, KIND.load, KIND.load_cached
resolve_bases = KIND.resolve
