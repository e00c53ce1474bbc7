"""KVTC's calibration artifact: one model's PCA bases and bit allocations, in a safetensors file.

KVTC fits its transform once per model (arXiv 2511.01815, Sec. 3): each token's keys of every
layer and KV head, RoPE undone, side by side (``F = sum over layers of H * D`` features), and
likewise its values, each have a mean and a PCA basis; a bit allocation per target ratio says
how each basis's components are stored. Every cache the model makes is coded on that basis, so
the basis is not stored with a cache: a KVTC file names it (:attr:`KvtcBasis.basis_id`, a
SHA-256 over every array and the plans) and counts its size.

A file holds, per side ``s`` (``key``, ``value``), ``<s>.mean`` float32 ``(F,)`` and
``<s>.basis`` float16 ``(F, r_s)`` (orthonormal columns, largest variance first; ``r_s`` the
components the widest plan stores), and per layer ``i`` ``rope.<i>.theta`` float32. Its
metadata: ``format="velox-kvtc"``, a version, the model's fingerprint, identity and
calibration, ``layers``, ``geometry`` (per layer ``[kv_heads, key_dim, value_dim]``),
``layouts`` (per layer the RoPE's ``[dims, traditional]``), ``plans`` (``{ratio: {side:
[[size, dtype], ...]}}``), ``variance`` (per side, each component's calibration variance) and
``basis_id``.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import numpy as np

from velox_core.artifacts import ArtifactFile, ArtifactKind, Fitted
from velox_core.ops.rope import RopeSpec

from .allocation import Plan

__all__ = [
    "FORMAT",
    "HOW_TO_FIT",
    "SIDES",
    "KvtcBasis",
    "MissingBasisError",
    "load_basis",
    "load_basis_cached",
    "resolve_basis",
    "save_basis",
]

FORMAT = "velox-kvtc"
VERSION = "1"
SIDES = ("key", "value")


class MissingBasisError(FileNotFoundError):
    """No KVTC artifact was found for a model."""


@dataclass
class KvtcBasis(Fitted):
    """A model's fitted KVTC transform (``fingerprint``, ``model``, ``calibration``:
    :class:`~velox_core.artifacts.Fitted`).

    Attributes:
        means: side -> float32 ``(F,)``.
        bases: side -> float16 ``(F, r)``.
        geometry: layer -> ``(kv_heads, key_dim, value_dim)``, layers in order.
        ropes: layer -> the RoPE its keys were un-rotated with.
        plans: ratio (str, as the file writes it) -> side -> :class:`~velox_kvtc.allocation.Plan`.
        variance: side -> each component's calibration variance (float64 list).
    """

    noun = "basis"
    means: dict[str, mx.array]
    bases: dict[str, mx.array]
    geometry: dict[int, tuple[int, int, int]]
    ropes: dict[int, RopeSpec]
    plans: dict[str, dict[str, Plan]]
    variance: dict[str, list[float]]

    @property
    def layers(self) -> list[int]:
        return sorted(self.geometry)

    def features(self, side: str) -> int:
        """``F``: the width of a token's row of keys (or values) over every layer and head."""
        d = 1 if side == "key" else 2
        return sum(g[0] * g[d] for g in self.geometry.values())

    @property
    def nbytes(self) -> int:
        """Bytes of the arrays a KVTC file relies on (bases, means, RoPE frequencies)."""
        return sum(int(a.nbytes) for a in self.arrays().values())

    def arrays(self) -> dict[str, mx.array]:
        out = {}
        for s in SIDES:
            out[f"{s}.mean"] = self.means[s].astype(mx.float32)
            out[f"{s}.basis"] = self.bases[s].astype(mx.float16)
        for i, r in self.ropes.items():
            out[f"rope.{i}.theta"] = mx.array(r.theta)
        return out

    @property
    def basis_id(self) -> str:
        """SHA-256 over the arrays (names, dtypes, shapes, bytes), geometry, RoPEs and plans."""
        h = hashlib.sha256()
        arrays = self.arrays()
        for name in sorted(arrays):
            a = mx.contiguous(arrays[name])
            h.update(f"{name}|{a.dtype}|{tuple(a.shape)}|".encode())
            h.update(np.asarray(a.view(mx.uint8) if a.size else a).tobytes())
        h.update(json.dumps(self._meta_json(), sort_keys=True).encode())
        return h.hexdigest()

    def plan(self, ratio: str, side: str) -> Plan:
        if ratio not in self.plans:
            have = ", ".join(sorted(self.plans, key=float))
            raise ValueError(f"kvtc: this basis has no plan for ratio {ratio} (it has: {have})")
        return self.plans[ratio][side]

    def _meta_json(self) -> dict[str, Any]:
        return {
            "geometry": {str(i): list(g) for i, g in self.geometry.items()},
            "layouts": {str(i): r.layout for i, r in self.ropes.items()},
            "plans": {k: {s: p.to_json() for s, p in v.items()} for k, v in self.plans.items()},
        }

    def check(self, where: str) -> None:
        """Refuse an inconsistent artifact (``ValueError`` naming ``where``)."""
        if not self.geometry or set(self.ropes) != set(self.geometry):
            raise ValueError(f"{where}: every layer needs its geometry and RoPE")
        for s in SIDES:
            f = self.features(s)
            mean, basis = self.means.get(s), self.bases.get(s)
            if mean is None or basis is None or mean.shape != (f,) or basis.ndim != 2:
                raise ValueError(f"{where}: the {s} mean must be ({f},), its basis (F, r)")
            if basis.shape[0] != f or basis.shape[1] > f:
                raise ValueError(f"{where}: the {s} basis must be ({f}, r <= {f})")
            if len(self.variance.get(s, ())) < basis.shape[1]:
                raise ValueError(f"{where}: the {s} variances do not cover its basis")
        if not self.plans:
            raise ValueError(f"{where}: no bit allocation (plans) recorded")
        for ratio, sides in self.plans.items():
            for s in SIDES:
                p = sides.get(s)
                if p is None or p.components > self.bases[s].shape[1]:
                    raise ValueError(
                        f"{where}: the plan of ratio {ratio} for {s}s is missing or covers "
                        "more components than the basis holds"
                    )
        for i, (h, dk, dv) in self.geometry.items():
            if min(h, dk, dv) < 1 or self.ropes[i].dims > dk:
                raise ValueError(f"{where}: layer {i} has a bad geometry {(h, dk, dv)}")

    def encode(self) -> tuple[dict[str, mx.array], dict[str, Any]]:
        own = {**self._meta_json(), "variance": self.variance, "basis_id": self.basis_id}
        return self.arrays(), own

    @classmethod
    def decode(cls, f: ArtifactFile) -> KvtcBasis:
        layouts = f.per_layer("layouts", int)
        ropes = {
            i: RopeSpec(np.array(f.arrays[f"rope.{i}.theta"], np.float32), lay[0], bool(lay[1]))
            for i, lay in layouts.items()
        }
        plans = {
            str(k): {s: Plan.from_json(v[s], f"plan {k} {s}") for s in SIDES}
            for k, v in f.json("plans").items()
        }
        out = cls(
            {s: f.arrays[f"{s}.mean"] for s in SIDES},
            {s: f.arrays[f"{s}.basis"] for s in SIDES},
            {i: tuple(g) for i, g in f.per_layer("geometry", int).items()},
            ropes,
            plans,
            {s: [float(x) for x in f.json("variance")[s]] for s in SIDES},
            **f.provenance(),
        )
        if out.basis_id != f.meta.get("basis_id"):
            raise ValueError("its arrays or plans do not match its basis_id (altered or truncated)")
        return out


KIND = ArtifactKind(FORMAT, VERSION, "KVTC", "basis", missing=MissingBasisError, record=KvtcBasis)
HOW_TO_FIT = KIND.how_to_fit
# save_basis(b, path) and load_basis(path) (ValueError if it is not one, or an inconsistent
# one), load_basis_cached(path) (read once per file version) and resolve_basis(model,
# path=None) (``path`` if given, checked; else found by the model's fingerprint;
# MissingBasisError where none is): :class:`velox_core.artifacts.ArtifactKind`.
save_basis, load_basis, load_basis_cached = KIND.save, KIND.load, KIND.load_cached
resolve_basis = KIND.resolve
