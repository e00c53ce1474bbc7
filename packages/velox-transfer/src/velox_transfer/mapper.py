"""A fitted mapper and its directory: a JSON manifest and one safetensors file per layer.

``manifest.json`` holds the format and version, both models' fingerprints, identities and
specs (:class:`velox_transfer.spec.ModelSpec`), per target layer its source layers and
lags, ridge strength, held-out R² (keys and values, all heads and per head), file name, byte
size and SHA-256, the calibration record, and a SHA-256 of the manifest itself (over its
canonical JSON without that field). ``layer.<i>.safetensors`` holds ``w`` (float32
``(F, O)``: the concatenated source features, lag-major then source layer, to the target
layer's keys and values) and ``b`` (``(O,)``).
A loaded mapper reads a layer file when that layer is first mapped, and refuses it unless
its size and checksum are the manifest's.
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
VERSION = 2  # 2: per-layer lags (w's rows are lag-major); 1 had none
MANIFEST = "manifest.json"
HOW_TO_FIT = "python -m velox_transfer fit --source SRC --target TGT --out DIR"


class MapperError(ValueError):
    """A mapper directory that cannot be used: foreign, corrupt, or of another version."""


@dataclass(frozen=True)
class LayerMap:
    """One target layer's map: ``y[t] = x @ w + b``, ``x`` the ``sources`` layers' features
    at positions ``t - l`` for ``l`` in ``lags`` (lag-major, then source layer)."""

    sources: tuple[int, ...]
    lags: tuple[int, ...]
    w: mx.array
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
        info: per target layer, the manifest's record (``sources``, ``alpha``, R²...).
        calibration: how the mapper was fitted.
        layers: target layer -> :class:`LayerMap`, for a fitted mapper.
        path: the directory of a loaded mapper (its layers are read on first use).
    """

    def __init__(
        self,
        source: ModelSpec,
        target: ModelSpec,
        info: list[dict[str, Any]],
        calibration: dict[str, Any],
        *,
        layers: dict[int, LayerMap] | None = None,
        path: Path | None = None,
    ):
        if len(info) != len(target.layers):
            raise MapperError(f"{len(info)} layer records for {len(target.layers)} target layers")
        self.source, self.target, self.info, self.calibration = source, target, info, calibration
        self.path = path
        self.version = VERSION
        self._layers: dict[int, LayerMap] = dict(layers or {})
        if path is None and len(self._layers) != len(target.layers):
            raise MapperError("a mapper without a directory needs every target layer's map")

    def sources(self, i: int) -> tuple[int, ...]:
        return tuple(self.info[i]["sources"])

    def lags(self, i: int) -> tuple[int, ...]:
        return tuple(self.info[i]["lags"])

    def shape(self, i: int) -> tuple[int, int]:
        """``(F, O)`` of target layer ``i``'s weights."""
        f = sum(self.source.layers[j].features for j in self.sources(i)) * len(self.lags(i))
        return f, self.target.layers[i].features

    def layer(self, i: int) -> LayerMap:
        """Target layer ``i``'s map (read and checked on first use for a loaded mapper)."""
        if not 0 <= i < len(self.target.layers):
            raise ValueError(f"the target has no layer {i} ({len(self.target.layers)} layers)")
        if i not in self._layers:
            self._layers[i] = self._read(i)
        return self._layers[i]

    def _read(self, i: int) -> LayerMap:
        rec, path = self.info[i], self.path / self.info[i]["file"]
        try:
            data = path.read_bytes()
        except OSError as e:
            raise MapperError(f"{path}: cannot read the layer file ({e})") from None
        if len(data) != rec["bytes"] or _sha(data) != rec["sha256"]:
            raise MapperError(
                f"{path}: {len(data)} bytes whose SHA-256 is not the manifest's (expected "
                f"{rec['bytes']} bytes): the file is truncated or altered; fit the mapper again"
            )
        try:
            arrays = mx.load(str(path))
            w, b = arrays["w"], arrays["b"]
        except (KeyError, RuntimeError, ValueError) as e:
            raise MapperError(f"{path}: not a velox-transfer layer file ({e})") from None
        f, o = self.shape(i)
        if tuple(w.shape) != (f, o) or tuple(b.shape) != (o,):
            raise MapperError(
                f"{path}: w {tuple(w.shape)} / b {tuple(b.shape)}, expected ({f}, {o}) / ({o},)"
            )
        return LayerMap(self.sources(i), self.lags(i), w.astype(mx.float32), b.astype(mx.float32))

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
        layers = []
        for i, rec in enumerate(self.info):
            m = self.layer(i)
            name = f"layer.{i}.safetensors"
            mx.save_safetensors(str(out / name), {"w": m.w, "b": m.b})
            data = (out / name).read_bytes()
            layers.append({**rec, "file": name, "bytes": len(data), "sha256": _sha(data)})
        manifest = {
            "format": FORMAT,
            "version": VERSION,
            "source": self.source.to_json(),
            "target": self.target.to_json(),
            "layers": layers,
            "calibration": self.calibration,
        }
        manifest["checksum"] = _manifest_sha(manifest)
        (out / MANIFEST).write_text(json.dumps(manifest, indent=1, sort_keys=True) + "\n")
        self.info = layers
        return out

    def describe(self) -> list[str]:
        """One line per target layer: its sources and held-out R²."""
        return [
            f"target layer {i}: source layers {rec['sources']}, lags {rec['lags']}, alpha "
            f"{rec['alpha']:g}{' (an end of the grid)' if rec.get('alpha_at_edge') else ''}, "
            f"held-out R² keys {rec['r2_key']:.3f} values {rec['r2_value']:.3f}"
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
        info = list(manifest["layers"])
        for i, rec in enumerate(info):
            if not all(0 <= int(j) < len(src.layers) for j in rec["sources"]) or not rec["sources"]:
                raise ValueError(f"layer {i} lists source layers {rec['sources']}")
            lags = rec["lags"]
            if not lags or any(not isinstance(x, int) or x < 0 for x in lags):
                raise ValueError(f"layer {i} lists lags {lags}")
            size = (root / rec["file"]).stat().st_size
            if size != rec["bytes"]:
                raise ValueError(
                    f"{rec['file']} has {size} bytes, the manifest says {rec['bytes']}"
                )
        mapper = Mapper(src, tgt, info, dict(manifest.get("calibration", {})), path=root)
    except (KeyError, TypeError, ValueError, OSError) as e:
        raise MapperError(f"{root}: corrupt mapper ({e})") from None
    mapper.check_models(source, target)
    return mapper
