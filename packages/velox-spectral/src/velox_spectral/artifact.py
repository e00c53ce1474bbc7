"""Spectral artifacts: a model's PCA bases of the post-RoPE keys and of the values, per layer
and KV head, in a safetensors file.

A file holds, per attention layer ``i`` and side ``s`` (``key``, ``value``):

* ``layer.<i>.<s>.basis``: int8 ``(H, D, D)`` and ``layer.<i>.<s>.basis_scale``: float32
  ``(H, D)``: each KV head's orthonormal eigenvectors of its covariance as columns, largest
  eigenvalue first, each column as int8 codes times its scale (:func:`int8_columns`, as the
  caches hold them);
* ``layer.<i>.<s>.mean``: float32 ``(H, D)``, each head's mean vector;
* ``layer.<i>.<s>.eigenvalues``: float32 ``(H, D)``, descending: the variance of each
  component (the codes scale component ``j`` by ``sqrt(eigenvalues[j])``, and a ``variance``
  setting picks the rank from their running sum).

Its metadata: ``format="velox-spectral"``, a version, the model's fingerprint and identifying
config, and how it was fitted (``calibration``: tokens, sequence length, ``skip``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import numpy as np

from velox_core.artifacts import ArtifactFile, ArtifactKind, FittedLayers

__all__ = [
    "FORMAT",
    "HOW_TO_FIT",
    "MissingArtifactError",
    "SpectralBases",
    "int8_columns",
    "load_bases",
    "load_bases_cached",
    "resolve_bases",
    "save_bases",
]

FORMAT = "velox-spectral"
VERSION = "1"
SIDES = ("key", "value")
FIELDS = ("basis", "basis_scale", "mean", "eigenvalues")


def int8_columns(basis: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Each column of each head's basis as int8 codes times a float32 scale (its largest
    magnitude over 127): ``basis ~ codes * scale[:, None, :]``, to half an int8 step.

    Shapes: basis ``(H, D, k)``; returns int8 ``(H, D, k)`` and float32 ``(H, k)``.
    """
    scale = np.maximum(np.abs(basis).max(axis=1), 1e-30) / 127.0
    codes = np.clip(np.rint(basis / scale[:, None, :]), -127, 127).astype(np.int8)
    return codes, scale.astype(np.float32)


class MissingArtifactError(FileNotFoundError):
    """No spectral artifact was found for a model."""


@dataclass
class SpectralBases(FittedLayers):
    """Fitted PCA bases of one model (``fingerprint``, ``model``, ``calibration`` and
    ``layer(i)``: :class:`~velox_core.artifacts.FittedLayers`).

    Attributes:
        layers: layer -> ``{"key": {"basis", "basis_scale", "mean", "eigenvalues"},
            "value": {...}}`` (int8 ``(H, D, D)``, then ``(H, D)`` arrays).
    """

    what = "spectral bases"
    noun = "bases"
    layers: dict[int, dict[str, dict[str, mx.array]]]

    def side(self, layer: int, side: str) -> dict[str, mx.array]:
        """One layer's ``basis``, ``basis_scale``, ``mean`` and ``eigenvalues`` of ``side``
        (``ValueError`` naming the fitted layers)."""
        return self.layer(layer)[side]

    def check(self, where: str) -> None:
        """``ValueError`` naming ``where`` unless every layer's sides hold an int8 ``(H, D,
        D)`` basis, ``(H, D)`` scales, means and eigenvalues (>= 0, descending)."""
        if not self.layers:
            raise ValueError(f"{where}: no layers")
        for i, sides in self.layers.items():
            for s in SIDES:
                a = sides.get(s) or {}
                basis, scale, mean, lam = (a.get(f) for f in FIELDS)
                if basis is None or basis.ndim != 3 or basis.shape[1] != basis.shape[2]:
                    raise ValueError(f"{where}: layer {i} {s}: the basis must be (H, D, D)")
                if basis.dtype != mx.int8:
                    raise ValueError(f"{where}: layer {i} {s}: the basis must be int8 codes")
                h, d = basis.shape[0], basis.shape[1]
                for name, x in (("basis_scale", scale), ("mean", mean), ("eigenvalues", lam)):
                    if x is None or tuple(x.shape) != (h, d):
                        raise ValueError(f"{where}: layer {i} {s}: {name} must be ({h}, {d})")
                if mx.any(lam < 0).item() or mx.any(lam[:, 1:] > lam[:, :-1]).item():
                    raise ValueError(
                        f"{where}: layer {i} {s}: eigenvalues must be >= 0 and descending"
                    )

    def encode(self) -> tuple[dict[str, mx.array], dict[str, Any]]:
        arrays = {
            f"layer.{i}.{s}.{f}": a if f == "basis" else a.astype(mx.float32)
            for i, sides in self.layers.items()
            for s, fields in sides.items()
            for f, a in fields.items()
        }
        return arrays, {}

    @classmethod
    def decode(cls, f: ArtifactFile) -> SpectralBases:
        layers = {
            i: {s: {n: f.arrays[f"layer.{i}.{s}.{n}"] for n in FIELDS} for s in SIDES}
            for i in f.layers
        }
        return cls(layers, **f.provenance())


KIND = ArtifactKind(
    FORMAT, VERSION, "spectral", "artifact", missing=MissingArtifactError, record=SpectralBases
)
HOW_TO_FIT = KIND.how_to_fit
# save_bases(r, path) and load_bases(path) (ValueError if it is not one, or an inconsistent
# one), load_bases_cached(path) (read once per file version: every layer's cache shares it)
# and resolve_bases(model, path=None) (``path`` if given, checked; else found by the model's
# fingerprint; MissingArtifactError where none is): :class:`ArtifactKind`.
save_bases, load_bases, load_bases_cached = KIND.save, KIND.load, KIND.load_cached
resolve_bases = KIND.resolve
