"""OSCAR artifacts: a model's fitted key and value rotations and clip ratios, in a safetensors
file.

A file holds, per attention layer ``i``:

* ``layer.<i>.key`` and ``layer.<i>.value``: float16 ``(D, D)`` (as the caches hold them),
  the orthogonal rotations ``R_K = U_Q H P_br`` and ``R_V = U_S H P_br``
  (:mod:`velox_oscar.rotation`), one per layer shared by its KV heads (the covariances are
  averaged over the heads, GQA-aware, as the authors' ``compute_kv_rotation.py`` does);
* ``layer.<i>.key_eigenvalues`` and ``layer.<i>.value_eigenvalues``: float32 ``(D,)``, the
  eigenvalues of ``C_Q`` and ``C_S`` (ascending), which ordered ``P_br``;
* ``layer.<i>.key_mean``: float32 ``(H, D)``, each KV head's mean post-RoPE key over the
  calibration tokens (the shift ``centre=True`` takes off every key before it is coded).

Its metadata: ``format="velox-oscar"``, a version, the model's fingerprint and identifying
config, how it was fitted, and per layer the fitted clip ratios ``clips`` (for each code width
2 to 8, ``[key, value]``, for the OSCAR rotations) and ``hadamard_clips`` (the same fit for
the plain Hadamard basis, the paper's ablation), ``centred_clips`` and
``hadamard_centred_clips`` (the same with the keys less their mean; the value ratios are the
uncentred ones), with the group they were fitted for (``fit_group``; 0: the caches' default,
the whole head up to 128 channels). Version 2 added the key means and the centred clips.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import mlx.core as mx

from velox_core.artifacts import ArtifactFile, ArtifactKind, FittedLayers

__all__ = [
    "FORMAT",
    "HOW_TO_FIT",
    "MissingArtifactError",
    "OscarRotations",
    "load_rotations",
    "load_rotations_cached",
    "resolve_rotations",
    "save_rotations",
]

FORMAT = "velox-oscar"
VERSION = "2"
SIDES = ("key", "value")


class MissingArtifactError(FileNotFoundError):
    """No OSCAR artifact was found for a model."""


@dataclass
class OscarRotations(FittedLayers):
    """Fitted OSCAR rotations of one model (``fingerprint``, ``model``, ``calibration`` and
    ``layer(i)``: :class:`~velox_core.artifacts.FittedLayers`).

    Attributes:
        layers: layer -> ``{"key": R_K, "value": R_V, "key_eigenvalues": ...,
            "value_eigenvalues": ..., "key_mean": ...}`` (``(D, D)``, ``(D,)`` and, the
            key mean of each KV head, ``(H, D)`` arrays).
        clips: layer -> code width -> ``[key, value]`` clip ratios fitted for the OSCAR
            rotations.
        hadamard_clips: the same for the Hadamard basis.
        centred_clips, hadamard_centred_clips: the same two with the keys centred on
            ``key_mean``.
        fit_group: the group the clips were fitted for (0: the caches' default, the whole
            head up to 128 channels).
    """

    what = "OSCAR rotations"
    noun = "rotations"
    layers: dict[int, dict[str, mx.array]]
    clips: dict[int, dict[int, list[float]]]
    hadamard_clips: dict[int, dict[int, list[float]]]
    centred_clips: dict[int, dict[int, list[float]]]
    hadamard_centred_clips: dict[int, dict[int, list[float]]]
    fit_group: int

    def rotation(self, layer: int, side: str) -> mx.array:
        """``R_K`` or ``R_V`` of one layer (``ValueError`` naming the fitted layers)."""
        return self.layer(layer)[side]

    def tables(self) -> dict[str, dict[int, dict[int, list[float]]]]:
        """The four clip tables by their metadata names."""
        return {
            "clips": self.clips,
            "hadamard_clips": self.hadamard_clips,
            "centred_clips": self.centred_clips,
            "hadamard_centred_clips": self.hadamard_centred_clips,
        }

    def key_mean(self, layer: int) -> mx.array:
        """Each KV head's mean key of one layer, float32 ``(H, D)``."""
        return self.layer(layer)["key_mean"]

    def clip(
        self, layer: int, side: str, bits: int, basis: str = "oscar", centred: bool = False
    ) -> float:
        """The clip ratio fitted for one layer's keys or values at ``bits`` in ``basis``
        (``"oscar"`` or ``"hadamard"``), the keys centred on their mean where ``centred``."""
        self.layer(layer)
        name = ("" if basis == "oscar" else "hadamard_") + ("centred_" if centred else "")
        table = self.tables()[name + "clips"][layer]
        if bits not in table:
            raise ValueError(
                f"oscar: the artifact's clip ratios were fitted for {sorted(table)} bits, not "
                f"{bits}; pass key_clip and value_clip"
            )
        return float(table[bits][SIDES.index(side)])

    def check(self, where: str) -> None:
        """``ValueError`` naming ``where`` unless every layer has both rotations, their
        eigenvalues and two clip ratios in (0, 1] per code width in both bases."""
        if not self.layers:
            raise ValueError(f"{where}: no layers")
        for i, arrays in self.layers.items():
            for s in SIDES:
                m, lam = arrays.get(s), arrays.get(f"{s}_eigenvalues")
                if m is None or m.ndim != 2 or m.shape[0] != m.shape[1]:
                    raise ValueError(f"{where}: layer {i} {s}: the rotation must be (D, D)")
                if lam is None or lam.shape != (m.shape[0],):
                    raise ValueError(f"{where}: layer {i} {s}: eigenvalues must be (D,)")
            mean = arrays.get("key_mean")
            if mean is None or mean.ndim != 2 or mean.shape[1] != arrays["key"].shape[0]:
                raise ValueError(f"{where}: layer {i}: key_mean must be (H, D)")
            for name, table in self.tables().items():
                widths = table.get(i)
                if not widths or not all(
                    len(p) == 2 and all(0.0 < c <= 1.0 for c in p) for p in widths.values()
                ):
                    raise ValueError(
                        f"{where}: layer {i}: {name} must give two ratios in (0, 1] per code width"
                    )

    def encode(self) -> tuple[dict[str, mx.array], dict[str, Any]]:
        arrays = {
            f"layer.{i}.{name}": a.astype(mx.float16 if name in SIDES else mx.float32)
            for i, layer in self.layers.items()
            for name, a in layer.items()
        }
        return arrays, {**self.tables(), "fit_group": str(self.fit_group)}

    @classmethod
    def decode(cls, f: ArtifactFile) -> OscarRotations:
        names = (*SIDES, *(f"{s}_eigenvalues" for s in SIDES), "key_mean")
        layers = {i: {n: f.arrays[f"layer.{i}.{n}"] for n in names} for i in f.layers}

        def widths(name: str) -> dict[int, dict[int, list[float]]]:
            return {
                int(i): {int(b): [float(c) for c in p] for b, p in w.items()}
                for i, w in f.json(name).items()
            }

        tables = [widths(n) for n in ("clips", "hadamard_clips")]
        tables += [widths(n) for n in ("centred_clips", "hadamard_centred_clips")]
        return cls(layers, *tables, int(f.meta["fit_group"]), **f.provenance())


KIND = ArtifactKind(
    FORMAT, VERSION, "OSCAR", "artifact", missing=MissingArtifactError, record=OscarRotations
)
HOW_TO_FIT = KIND.how_to_fit
# save_rotations(r, path) and load_rotations(path) (ValueError if it is not one, or an
# inconsistent one), load_rotations_cached(path) (read once per file version: every layer's
# cache shares it) and resolve_rotations(model, path=None) (``path`` if given, checked; else
# found by the model's fingerprint; MissingArtifactError where none is): :class:`ArtifactKind`.
save_rotations, load_rotations, load_rotations_cached = KIND.save, KIND.load, KIND.load_cached
resolve_rotations = KIND.resolve
