"""CommVQ artifacts: the fitted key codebooks of one model, in a safetensors file.

A file holds, per attention layer ``i``, ``layer.<i>.a`` and ``layer.<i>.b``: float16
``(H_kv, S, P, K, 2)`` codebooks (:mod:`velox_commvq.vq`), and in its metadata
``format="velox-commvq"``, a version, the model's fingerprint
(:func:`velox_commvq.fingerprint`) and identifying config, the pairs per code ``G``, each
layer's RoPE pair layout ``[dims, traditional]`` and how the codebooks were fitted. A cache
finds the file of its model by that fingerprint (:func:`resolve_codebooks`): an explicit path
wins; otherwise the directories of ``$VELOX_ARTIFACTS`` (colon-separated), then
``~/.cache/velox``. A model without one is an error, never a random codebook.
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
from .vq import Geometry

__all__ = [
    "ENV",
    "FORMAT",
    "Codebooks",
    "MissingCodebooksError",
    "find_codebooks",
    "load_cached",
    "load_codebooks",
    "read_metadata",
    "resolve_codebooks",
    "save_codebooks",
    "search_dirs",
]

FORMAT = "velox-commvq"
VERSION = "1"
ENV = "VELOX_ARTIFACTS"
HOW_TO_FIT = "python -m velox_commvq fit --model PATH --text CALIBRATION.txt --out FILE"


class MissingCodebooksError(FileNotFoundError):
    """No CommVQ artifact was found for a model."""


@dataclass
class Codebooks:
    """Fitted CommVQ key codebooks of one model.

    Attributes:
        layers: layer index -> ``(a, b)``, each ``(H_kv, S, P, K, 2)``; pair ``p`` of stage
            ``s`` codes as ``a[h, s, p, c1] + J b[h, s, p, c2]``.
        layouts: layer index -> ``[dims, traditional]`` of the RoPE it was fitted under.
        pairs: RoPE pairs sharing one code per stage (``G``).
        fingerprint: the model's fingerprint.
        model: the model's identifying config.
        calibration: how the codebooks were fitted.
    """

    layers: dict[int, tuple[mx.array, mx.array]]
    layouts: dict[int, list[int]]
    pairs: int
    fingerprint: str
    model: dict[str, Any] = field(default_factory=dict)
    calibration: dict[str, Any] = field(default_factory=dict)

    def layer(self, i: int) -> tuple[mx.array, mx.array]:
        if i not in self.layers:
            raise ValueError(
                f"these CommVQ codebooks have no layer {i} (fitted: {sorted(self.layers)})"
            )
        return self.layers[i]

    @property
    def geometry(self) -> Geometry:
        a = next(iter(self.layers.values()))[0]
        return Geometry(self.pairs, int(a.shape[3]), int(a.shape[1]))


def save_codebooks(books: Codebooks, path: str | os.PathLike) -> Path:
    """Write ``books`` to ``path`` (``.safetensors``; parent directories are created)."""
    path = Path(path).expanduser()
    if path.suffix != ".safetensors":
        raise ValueError(f"save_codebooks: the file name must end in .safetensors, got {path}")
    if not books.layers:
        raise ValueError("save_codebooks: no layers to save")
    arrays = {}
    for i, (a, b) in books.layers.items():
        if a.ndim != 5 or a.shape != b.shape or a.shape[-1] != 2:
            raise ValueError(f"save_codebooks: layer {i} must be two (H, S, P, K, 2) arrays")
        arrays[f"layer.{i}.a"], arrays[f"layer.{i}.b"] = a.astype(mx.float16), b.astype(mx.float16)
    meta = {
        "format": FORMAT,
        "version": VERSION,
        "fingerprint": books.fingerprint,
        "layers": json.dumps(sorted(books.layers)),
        "layouts": json.dumps({str(i): v for i, v in sorted(books.layouts.items())}),
        "pairs": str(books.pairs),
        "model": json.dumps(books.model, sort_keys=True),
        "calibration": json.dumps(books.calibration, sort_keys=True),
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(path), arrays, meta)
    return path


def read_metadata(path: str | os.PathLike) -> dict[str, str]:
    """The safetensors metadata of ``path``, read from its header only."""
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
        raise ValueError(f"{path}: not a CommVQ artifact (format {meta.get('format')!r})")
    if meta.get("version") != VERSION:
        raise ValueError(f"{path}: unsupported CommVQ artifact version {meta.get('version')!r}")


def load_codebooks(path: str | os.PathLike) -> Codebooks:
    """Read a file written by :func:`save_codebooks` (``ValueError`` if it is not one)."""
    path = Path(path).expanduser()
    meta = read_metadata(path)
    _check_format(path, meta)
    try:
        arrays = mx.load(str(path))
        ids = [int(i) for i in json.loads(meta["layers"])]
        layers = {i: (arrays[f"layer.{i}.a"], arrays[f"layer.{i}.b"]) for i in ids}
        layouts = {int(i): [int(x) for x in v] for i, v in json.loads(meta["layouts"]).items()}
        out = Codebooks(
            layers,
            layouts,
            int(meta["pairs"]),
            meta["fingerprint"],
            json.loads(meta["model"]),
            json.loads(meta["calibration"]),
        )
    except (KeyError, TypeError, ValueError, RuntimeError) as e:
        raise ValueError(f"{path}: corrupt CommVQ artifact ({e})") from None
    for i, (a, b) in out.layers.items():
        if a.ndim != 5 or a.shape != b.shape or a.shape[-1] != 2 or i not in out.layouts:
            raise ValueError(f"{path}: layer {i} is not two (H, S, P, K, 2) arrays with a layout")
        if a.shape[2] % out.pairs or a.shape[3] & (a.shape[3] - 1) or a.shape[3] < 2:
            raise ValueError(f"{path}: layer {i} has an inconsistent geometry {tuple(a.shape)}")
    return out


@lru_cache(maxsize=16)
def _load_cached(path: str, mtime_ns: int, size: int) -> Codebooks:
    return load_codebooks(path)


def load_cached(path: str | os.PathLike) -> Codebooks:
    """:func:`load_codebooks`, read once per file version (every layer's cache shares it)."""
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


def find_codebooks(fp: str, dirs: list[Path] | None = None) -> Path | None:
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


def resolve_codebooks(model: Any, codebooks: str | os.PathLike | None = None) -> Path:
    """The artifact to use for ``model``: ``codebooks`` if given (checked), else the lookup.

    Raises:
        ValueError: ``codebooks`` is not a CommVQ artifact or was fitted for another model.
        MissingCodebooksError: nothing in the search directories was fitted for this model.
    """
    fp = fingerprint(model)
    if codebooks is not None:
        path = Path(codebooks).expanduser()
        meta = read_metadata(path)
        _check_format(path, meta)
        if meta.get("fingerprint") != fp:
            raise ValueError(
                f"codebooks={str(codebooks)!r} were fitted for another model (fingerprint "
                f"{meta.get('fingerprint')}); this model's fingerprint is {fp} "
                f"({json.dumps(identity(model), sort_keys=True)}). Fit codebooks for it: "
                f"{HOW_TO_FIT}"
            )
        return path
    found = find_codebooks(fp)
    if found is None:
        where = ", ".join(str(d) for d in search_dirs())
        raise MissingCodebooksError(
            f"no CommVQ codebooks for this model (fingerprint {fp}) in {where}. CommVQ needs "
            f"codebooks fitted on the model's own keys: fit them with `{HOW_TO_FIT}` and put "
            f"FILE in ~/.cache/velox or a directory listed in ${ENV}, or pass codebooks=FILE"
        )
    return found
