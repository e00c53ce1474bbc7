"""Q-Filters artifacts: the fitted filters of one model, in a safetensors file.

A file holds one ``(H_kv, D)`` float32 array per attention layer (``layer.<i>``) and, in the
safetensors metadata, ``format="velox-qfilters"``, a version, the model's
:func:`~velox_qfilters.fingerprint.fingerprint`, its identifying config and how the filters
were fitted. The cache finds the file of a model by that fingerprint
(:func:`resolve_filters`): an explicit path wins; otherwise the directories of
``$VELOX_ARTIFACTS`` (colon-separated) and then ``~/.cache/velox`` are searched.

Deviation from the paper: the authors publish filters on the Hugging Face Hub under the
model's name; velox keeps them in a local file matched to the model by its weights.
"""

from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any

import mlx.core as mx

from .fingerprint import fingerprint, identity

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
ENV = "VELOX_ARTIFACTS"
HOW_TO_FIT = "python -m velox_qfilters fit --model PATH --text CALIBRATION.txt --out FILE"


class MissingFiltersError(FileNotFoundError):
    """No Q-Filters artifact was found for a model."""


@dataclass
class Filters:
    """Fitted Q-Filters of one model.

    Attributes:
        layers: layer index -> float32 ``(H_kv, D)`` filter of each KV head.
        fingerprint: the model's fingerprint (:func:`velox_qfilters.fingerprint`).
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
    path = Path(path).expanduser()
    if path.suffix != ".safetensors":
        raise ValueError(f"save_filters: the file name must end in .safetensors, got {path}")
    if not filters.layers:
        raise ValueError("save_filters: no layers to save")
    arrays = {}
    for i, f in filters.layers.items():
        if f.ndim != 2:
            raise ValueError(f"save_filters: layer {i} must be (H_kv, D), got {tuple(f.shape)}")
        arrays[f"layer.{i}"] = f.astype(mx.float32)
    meta = {
        "format": FORMAT,
        "version": VERSION,
        "fingerprint": filters.fingerprint,
        "layers": json.dumps(sorted(filters.layers)),
        "model": json.dumps(filters.model, sort_keys=True),
        "calibration": json.dumps(filters.calibration, sort_keys=True),
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(path), arrays, meta)
    return path


def read_metadata(path: str | os.PathLike) -> dict[str, str]:
    """The safetensors metadata of ``path``, read from its header only (no arrays loaded)."""
    path = Path(path).expanduser()
    try:
        with path.open("rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            if n > 1 << 26:
                raise ValueError("header too large")
            header = json.loads(f.read(n))
    except FileNotFoundError:
        raise ValueError(f"{path}: no such file") from None
    except (OSError, struct.error, ValueError, UnicodeDecodeError) as e:
        raise ValueError(f"{path}: not a safetensors file ({e})") from None
    meta = header.get("__metadata__", {}) if isinstance(header, dict) else {}
    return meta if isinstance(meta, dict) else {}


def _check_format(path: Path, meta: dict[str, str]) -> None:
    if meta.get("format") != FORMAT:
        raise ValueError(f"{path}: not a Q-Filters artifact (format {meta.get('format')!r})")
    if meta.get("version") != VERSION:
        raise ValueError(f"{path}: unsupported Q-Filters artifact version {meta.get('version')!r}")


def load_filters(path: str | os.PathLike) -> Filters:
    """Read a file written by :func:`save_filters` (``ValueError`` if it is not one)."""
    path = Path(path).expanduser()
    meta = read_metadata(path)
    _check_format(path, meta)
    try:
        arrays = mx.load(str(path))
        layers = {int(i): arrays[f"layer.{i}"] for i in json.loads(meta["layers"])}
        out = Filters(
            layers, meta["fingerprint"], json.loads(meta["model"]), json.loads(meta["calibration"])
        )
    except (KeyError, TypeError, ValueError, RuntimeError) as e:
        raise ValueError(f"{path}: corrupt Q-Filters artifact ({e})") from None
    for i, f in out.layers.items():
        if f.ndim != 2 or f.dtype != mx.float32:
            raise ValueError(f"{path}: layer {i} is not a float32 (H_kv, D) array")
    return out


@lru_cache(maxsize=16)
def _load_cached(path: str, mtime_ns: int, size: int) -> Filters:
    return load_filters(path)


def load_cached(path: str | os.PathLike) -> Filters:
    """:func:`load_filters`, read once per file version (caches of every layer share it)."""
    p = Path(path).expanduser()
    try:
        st = p.stat()
    except FileNotFoundError:
        raise ValueError(f"{p}: no such file") from None
    return _load_cached(str(p), st.st_mtime_ns, st.st_size)


def search_dirs() -> list[Path]:
    """Where artifacts are looked up: ``$VELOX_ARTIFACTS`` (in order), then ``~/.cache/velox``."""
    env = [Path(d).expanduser() for d in os.environ.get(ENV, "").split(":") if d]
    return [*env, Path("~/.cache/velox").expanduser()]


def find_filters(fp: str, dirs: list[Path] | None = None) -> Path | None:
    """The first artifact (directories in order, files sorted by name) fitted for ``fp``."""
    for d in search_dirs() if dirs is None else dirs:
        if not d.is_dir():
            continue
        for p in sorted(d.glob("*.safetensors")):
            try:
                meta = read_metadata(p)
            except ValueError:
                continue
            if meta.get("format") == FORMAT and meta.get("fingerprint") == fp:
                return p
    return None


def resolve_filters(model: Any, filters: str | os.PathLike | None = None) -> Path:
    """The artifact to use for ``model``: ``filters`` if given (checked), else the lookup.

    Raises:
        ValueError: ``filters`` is not a Q-Filters artifact or was fitted for another model.
        MissingFiltersError: nothing in the search directories was fitted for this model.
    """
    fp = fingerprint(model)
    if filters is not None:
        path = Path(filters).expanduser()
        meta = read_metadata(path)
        _check_format(path, meta)
        if meta.get("fingerprint") != fp:
            raise ValueError(
                f"filters={str(filters)!r} were fitted for another model (fingerprint "
                f"{meta.get('fingerprint')}, {meta.get('model')}); this model's fingerprint is "
                f"{fp} ({json.dumps(identity(model), sort_keys=True)}). Fit filters for it: "
                f"{HOW_TO_FIT}"
            )
        return path
    found = find_filters(fp)
    if found is None:
        where = ", ".join(str(d) for d in search_dirs())
        raise MissingFiltersError(
            f"no Q-Filters artifact for this model (fingerprint {fp}) in {where}. Fit one "
            f"with `{HOW_TO_FIT}` and put FILE in ~/.cache/velox or a directory listed in "
            f"${ENV}, or pass filters=FILE"
        )
    return found
