"""A fitted mapper and its directory: a JSON manifest and safetensors files.

Each target layer's map is factorised through a projection its group shares: target layers
that read the same source layers at the same lags form a group, and layer ``i`` of group
``g`` maps ``y = (x @ u_g) @ v_i + b_i``. ``x`` is the concatenated source features
(lag-major, then source layer; ``F`` wide), ``u_g`` is ``(F, r)``, ``v_i`` is ``(r, O)`` and
``b_i`` is ``(O,)``, ``O`` the target layer's keys and values. ``x @ u_g`` is computed once per
group and serves all its layers.

``manifest.json`` holds the format and version, both models' fingerprints, identities and
specs (:class:`velox_transfer.spec.ModelSpec`), the weights' storage dtype, per group its
source layers, lags, rank, target layers, file name, byte size and SHA-256, per target layer
its group, ridge strength, held-out R² (keys and values, all heads and per head; and the
unfactorised ridge map's), file name, byte size and SHA-256, the calibration record, and a
SHA-256 of the manifest itself (over its canonical JSON without that field).
``group.<g>.safetensors`` holds ``u``; ``layer.<i>.safetensors`` holds ``v`` (both in the
storage dtype) and ``b`` (float32). A loaded mapper reads a layer's file (and its group's,
if not read yet) when that layer is first mapped, and refuses any file unless its size and
checksum are the manifest's; the weights are computed in float32.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx

from velox_core.artifacts import fingerprint

from .spec import ModelSpec

__all__ = ["FORMAT", "VERSION", "LayerMap", "Mapper", "MapperError", "load_mapper"]

FORMAT = "velox-transfer"
VERSION = 3  # 3: factorised maps (u per group, v per layer); 2: one w per layer; 1: no lags
WEIGHT_DTYPES = {"float16": mx.float16, "bfloat16": mx.bfloat16, "float32": mx.float32}
MANIFEST = "manifest.json"
HOW_TO_FIT = "python -m velox_transfer fit --source SRC --target TGT --out DIR"


class MapperError(ValueError):
    """A mapper directory that cannot be used: foreign, corrupt, or of another version."""


@dataclass(frozen=True)
class LayerMap:
    """One target layer's map: ``y[t] = (x @ u) @ v + b``, ``x`` the ``sources`` layers'
    features at positions ``t - l`` for ``l`` in ``lags`` (lag-major, then source layer).

    Shapes (float32): u ``(F, r)``, shared by the layers of ``group``; v ``(r, O)``; b ``(O,)``.
    """

    sources: tuple[int, ...]
    lags: tuple[int, ...]
    group: int
    u: mx.array
    v: mx.array
    b: mx.array


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _manifest_sha(manifest: dict[str, Any]) -> str:
    body = {k: v for k, v in manifest.items() if k != "checksum"}
    return _sha(json.dumps(body, sort_keys=True, separators=(",", ":")).encode())


class Mapper:
    """Source caches to target caches, one ridge map per target layer.

    Args:
        source, target: the models' specs.
        info: per target layer, the manifest's record (``group``, ``alpha``, R²...).
        groups: per group, the manifest's record (``sources``, ``lags``, ``rank``, ``layers``).
        calibration: how the mapper was fitted.
        layers: target layer -> :class:`LayerMap`, for a fitted mapper.
        path: the directory of a loaded mapper (its layers are read on first use).
        weights_dtype: the storage dtype of ``u`` and ``v`` (a key of ``WEIGHT_DTYPES``).
    """

    def __init__(
        self,
        source: ModelSpec,
        target: ModelSpec,
        info: list[dict[str, Any]],
        groups: list[dict[str, Any]],
        calibration: dict[str, Any],
        *,
        layers: dict[int, LayerMap] | None = None,
        path: Path | None = None,
        weights_dtype: str = "float16",
    ):
        if len(info) != len(target.layers):
            raise MapperError(f"{len(info)} layer records for {len(target.layers)} target layers")
        if weights_dtype not in WEIGHT_DTYPES:
            raise MapperError(
                f"weights dtype {weights_dtype!r}; velox-transfer stores {sorted(WEIGHT_DTYPES)}"
            )
        self.source, self.target, self.info, self.calibration = source, target, info, calibration
        self.groups, self.weights_dtype = groups, weights_dtype
        self.path = path
        self.version = VERSION
        self._layers: dict[int, LayerMap] = dict(layers or {})
        self._u: dict[int, mx.array] = {m.group: m.u for m in self._layers.values()}
        if path is None and len(self._layers) != len(target.layers):
            raise MapperError("a mapper without a directory needs every target layer's map")

    def group(self, i: int) -> int:
        """The group of target layer ``i``."""
        return int(self.info[i]["group"])

    def sources(self, i: int) -> tuple[int, ...]:
        return tuple(self.groups[self.group(i)]["sources"])

    def lags(self, i: int) -> tuple[int, ...]:
        return tuple(self.groups[self.group(i)]["lags"])

    def rank(self, i: int) -> int:
        """``r``: the width of the projection target layer ``i``'s map goes through."""
        return int(self.groups[self.group(i)]["rank"])

    def shape(self, i: int) -> tuple[int, int]:
        """``(F, O)`` of target layer ``i``'s map (``u @ v``)."""
        f = sum(self.source.layers[j].features for j in self.sources(i)) * len(self.lags(i))
        return f, self.target.layers[i].features

    def nbytes(self) -> int:
        """Bytes of the weights (``u`` of every group, ``v`` and ``b`` of every layer) as
        stored."""
        size = WEIGHT_DTYPES[self.weights_dtype].size
        total = 0
        for i in range(len(self.target.layers)):
            o = self.shape(i)[1]
            total += self.rank(i) * o * size + o * 4  # v, and b in float32
        for g in self.groups:
            f = sum(self.source.layers[j].features for j in g["sources"]) * len(g["lags"])
            total += f * int(g["rank"]) * size
        return total

    def layer(self, i: int) -> LayerMap:
        """Target layer ``i``'s map (read and checked on first use for a loaded mapper)."""
        if not 0 <= i < len(self.target.layers):
            raise ValueError(f"the target has no layer {i} ({len(self.target.layers)} layers)")
        if i not in self._layers:
            self._layers[i] = self._read(i)
        return self._layers[i]

    def _read(self, i: int) -> LayerMap:
        g = self.group(i)
        (f, o), r = self.shape(i), self.rank(i)
        if g not in self._u:
            (u,) = self._load(self.groups[g], {"u": (f, r)}, self.weights_dtype)
            self._u[g] = u
        v, b = self._load(self.info[i], {"v": (r, o), "b": (o,)}, self.weights_dtype)
        return LayerMap(self.sources(i), self.lags(i), g, self._u[g], v, b)

    def _load(self, rec: dict[str, Any], shapes: dict[str, tuple], dtype: str) -> list:
        """The arrays ``shapes`` names from ``rec``'s file, checked against the manifest
        (size, SHA-256, shapes; ``u`` and ``v`` in the storage dtype), as float32."""
        path = self.path / rec["file"]
        try:
            data = path.read_bytes()
        except OSError as e:
            raise MapperError(f"{path}: cannot read the mapper file ({e})") from None
        if len(data) != rec["bytes"] or _sha(data) != rec["sha256"]:
            raise MapperError(
                f"{path}: {len(data)} bytes whose SHA-256 is not the manifest's (expected "
                f"{rec['bytes']} bytes): the file is truncated or altered; fit the mapper again"
            )
        try:
            arrays = mx.load(str(path))
            out = [arrays[name] for name in shapes]
        except (KeyError, RuntimeError, ValueError) as e:
            raise MapperError(f"{path}: not a velox-transfer mapper file ({e})") from None
        for (name, shape), a in zip(shapes.items(), out):
            want = mx.float32 if name == "b" else WEIGHT_DTYPES[dtype]
            if tuple(a.shape) != shape or a.dtype != want:
                raise MapperError(
                    f"{path}: {name} is {a.dtype} {tuple(a.shape)}, the manifest says {want} "
                    f"{shape}"
                )
        return [a.astype(mx.float32) for a in out]

    # -- models -------------------------------------------------------------------------
    def check_models(self, source: Any = None, target: Any = None) -> None:
        """Refuse models other than those the mapper was fitted for (``MapperError``)."""
        for role, model, spec in (("source", source, self.source), ("target", target, self.target)):
            if model is None:
                continue
            fp = fingerprint(model)
            if fp != spec.fingerprint:
                raise MapperError(
                    f"this mapper was fitted for a {role} model of fingerprint "
                    f"{spec.fingerprint} ({json.dumps(spec.identity, sort_keys=True)}); the "
                    f"{role} given has fingerprint {fp}. Fit a mapper for this pair: {HOW_TO_FIT}"
                )

    # -- files --------------------------------------------------------------------------
    def save(self, path: str | os.PathLike) -> Path:
        """Write the mapper's directory (created; existing mapper files are replaced)."""
        out = Path(path).expanduser()
        out.mkdir(parents=True, exist_ok=True)
        dt = WEIGHT_DTYPES[self.weights_dtype]

        def write(name: str, arrays: dict[str, mx.array]) -> dict[str, Any]:
            mx.save_safetensors(str(out / name), arrays)
            data = (out / name).read_bytes()
            return {"file": name, "bytes": len(data), "sha256": _sha(data)}

        maps = [self.layer(i) for i in range(len(self.info))]
        groups = []
        for g, rec in enumerate(self.groups):
            u = next(m.u for m in maps if m.group == g)
            groups.append({**rec, **write(f"group.{g}.safetensors", {"u": u.astype(dt)})})
        layers = [
            {**rec, **write(f"layer.{i}.safetensors", {"v": m.v.astype(dt), "b": m.b})}
            for i, (rec, m) in enumerate(zip(self.info, maps))
        ]
        manifest = {
            "format": FORMAT,
            "version": VERSION,
            "source": self.source.to_json(),
            "target": self.target.to_json(),
            "weights_dtype": self.weights_dtype,
            "groups": groups,
            "layers": layers,
            "calibration": self.calibration,
        }
        manifest["checksum"] = _manifest_sha(manifest)
        (out / MANIFEST).write_text(json.dumps(manifest, indent=1, sort_keys=True) + "\n")
        self.info, self.groups = layers, groups
        return out

    def describe(self) -> list[str]:
        """One line per target layer: its sources, rank and held-out R² (and the
        unfactorised ridge map's)."""
        return [
            f"target layer {i}: source layers {list(self.sources(i))}, lags "
            f"{list(self.lags(i))}, alpha {rec['alpha']:g}"
            f"{' (an end of the grid)' if rec.get('alpha_at_edge') else ''}, rank "
            f"{self.rank(i)}, held-out R² keys {rec['r2_key']:.3f} values {rec['r2_value']:.3f} "
            f"(unfactorised {rec['r2_key_full']:.3f} / {rec['r2_value_full']:.3f})"
            for i, rec in enumerate(self.info)
        ]


def load_mapper(path: str | os.PathLike, source: Any = None, target: Any = None) -> Mapper:
    """Open a mapper directory (layer files are read when first used).

    Args:
        source, target: if given, the models it must have been fitted for.

    Raises:
        MapperError: no manifest, another format or version, an altered manifest, a missing
            layer file or one of another size, or models of other fingerprints.
    """
    root = Path(path).expanduser()
    try:
        manifest = json.loads((root / MANIFEST).read_text())
    except FileNotFoundError:
        raise MapperError(f"{root}: no {MANIFEST}; not a velox-transfer mapper") from None
    except (OSError, ValueError, UnicodeDecodeError) as e:
        raise MapperError(f"{root / MANIFEST}: unreadable ({e})") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise MapperError(f"{root}: not a velox-transfer mapper")
    if manifest.get("version") != VERSION:
        raise MapperError(
            f"{root}: mapper format version {manifest.get('version')!r}; this velox-transfer "
            f"reads version {VERSION} only (the layer files' layout differs). Fit it again: "
            f"{HOW_TO_FIT}"
        )
    if manifest.get("checksum") != _manifest_sha(manifest):
        raise MapperError(f"{root / MANIFEST}: its checksum does not match; it was altered")
    try:
        src = ModelSpec.from_json(manifest["source"])
        tgt = ModelSpec.from_json(manifest["target"])
        info, groups = list(manifest["layers"]), list(manifest["groups"])
        _check_records(src, tgt, info, groups)
        for rec in [*groups, *info]:
            size = (root / rec["file"]).stat().st_size
            if size != rec["bytes"]:
                raise ValueError(
                    f"{rec['file']} has {size} bytes, the manifest says {rec['bytes']}"
                )
        mapper = Mapper(
            src,
            tgt,
            info,
            groups,
            dict(manifest.get("calibration", {})),
            path=root,
            weights_dtype=manifest["weights_dtype"],
        )
    except (KeyError, TypeError, ValueError, OSError) as e:
        raise MapperError(f"{root}: corrupt mapper ({e})") from None
    mapper.check_models(source, target)
    return mapper


def _check_records(src: ModelSpec, tgt: ModelSpec, info: list, groups: list) -> None:
    """Refuse group and layer records that do not describe a map of ``src`` to ``tgt``
    (``ValueError``): every group's source layers, lags and rank, and each target layer in
    exactly the group that lists it."""
    owner: dict[int, int] = {}
    for g, rec in enumerate(groups):
        sources, lags, rank = rec["sources"], rec["lags"], rec["rank"]
        if not sources or not all(isinstance(j, int) and 0 <= j < len(src.layers) for j in sources):
            raise ValueError(f"group {g} lists source layers {sources}")
        if not lags or any(not isinstance(x, int) or x < 0 for x in lags):
            raise ValueError(f"group {g} lists lags {lags}")
        if not isinstance(rank, int) or rank < 1:
            raise ValueError(f"group {g} has rank {rank!r}")
        for i in rec["layers"]:
            if not isinstance(i, int) or not 0 <= i < len(tgt.layers) or i in owner:
                raise ValueError(f"group {g} lists target layers {rec['layers']}")
            owner[i] = g
    for i, rec in enumerate(info):
        if owner.get(i) != rec["group"]:
            raise ValueError(
                f"layer {i} is in group {rec['group']!r}, the groups say {owner.get(i)}"
            )
