"""Per-model artifacts: what a method fits once on a model (codebooks, filters, projections,
mappers) and finds again by the model's fingerprint.

An artifact is a safetensors file whose metadata holds at least ``format`` (``"velox-<method>"``),
``version`` and the ``fingerprint`` of the model it was fitted on (a method may also keep a
directory with a manifest; it uses :func:`fingerprint` the same way). A cache resolves its
model's artifact with :func:`resolve_artifact`: an explicit path wins (checked: the right format
and version, fitted for this model); otherwise the directories of ``$VELOX_ARTIFACTS``
(colon-separated), then ``~/.cache/velox``, are searched. A model without one is an error that
says how to fit it, never a random artifact.

The fingerprint is a SHA-256 over the model's identifying config (:func:`identity`) and, for
every parameter array (sorted by name), its name, shape and 257 evenly spaced entries (float
entries rounded to bfloat16, so casting a checkpoint between float32, float16 and bfloat16,
e.g. to run it in float32 on a CPU, keeps its fingerprint; integer entries, such as packed
quantized weights, as raw bytes). Another checkpoint (another model, a fine-tune, a
quantization) changes it; one model has one fingerprint whatever the method.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import struct
from collections.abc import Callable
from functools import lru_cache
from pathlib import Path
from typing import Any, TypeVar

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten

__all__ = [
    "ENV",
    "check_format",
    "find_artifact",
    "fingerprint",
    "identity",
    "load_cached",
    "read_metadata",
    "resolve_artifact",
    "search_dirs",
]

ENV = "VELOX_ARTIFACTS"
_KEYS = (
    "model_type",
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "rope_theta",
    "rope_traditional",
    "rope_scaling",
    "partial_rotary_factor",
    "sliding_window",
    "vocab_size",
)
_SAMPLES = 257
T = TypeVar("T")


def identity(model: Any) -> dict[str, Any]:
    """The config entries that fix a model's attention geometry (those it has), and its class."""
    args = getattr(model, "args", None)
    if dataclasses.is_dataclass(args):
        cfg = dataclasses.asdict(args)
    elif isinstance(args, dict):
        cfg = dict(args)
    else:
        cfg = dict(getattr(args, "__dict__", {}))
    out = {"class": f"{type(model).__module__}.{type(model).__name__}"}
    for k in _KEYS:
        v = cfg.get(k)
        if v is None:
            continue
        try:
            json.dumps(v)
        except TypeError:
            v = repr(v)
        out[k] = v
    return out


def fingerprint(model: Any) -> str:
    """The model's fingerprint, a 32-digit hex string."""
    h = hashlib.sha256(json.dumps(identity(model), sort_keys=True).encode())
    params = tree_flatten(model.parameters())
    if not params:
        raise ValueError("fingerprint: the model has no parameters")
    samples = []
    for name, a in sorted(params, key=lambda p: p[0]):
        flat = a.reshape(-1)
        n = flat.size
        idx = np.unique(np.linspace(0, max(n - 1, 0), num=min(n, _SAMPLES)).astype(np.int64))
        s = flat[mx.array(idx)] if n else flat
        if mx.issubdtype(a.dtype, mx.floating):
            s = s.astype(mx.bfloat16).astype(mx.float32)
        samples.append((f"{name}|{tuple(a.shape)}|".encode(), s))
    mx.eval([s for _, s in samples])
    for tag, s in samples:
        h.update(tag)
        h.update(np.asarray(s).tobytes())
    return h.hexdigest()[:32]


def read_metadata(path: str | os.PathLike) -> dict[str, str]:
    """The safetensors metadata of ``path``, read from its header only (no arrays loaded).

    Raises:
        ValueError: no such file, or not a safetensors file.
    """
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


def check_format(path: Path, meta: dict[str, str], fmt: str, version: str, what: str) -> None:
    """Raise ``ValueError`` unless ``meta`` is of format ``fmt`` at ``version``; ``what`` names
    the artifact in the message (``"CommVQ"``)."""
    if meta.get("format") != fmt:
        raise ValueError(f"{path}: not a {what} artifact (format {meta.get('format')!r})")
    if meta.get("version") != version:
        raise ValueError(f"{path}: unsupported {what} artifact version {meta.get('version')!r}")


@lru_cache(maxsize=32)
def _load(loader: Callable[[Path], Any], path: str, mtime_ns: int, size: int) -> Any:
    return loader(Path(path))


def load_cached(loader: Callable[[Path], T], path: str | os.PathLike) -> T:
    """``loader(path)``, run once per file version (the caches of every layer share it).

    Raises:
        ValueError: no such file.
    """
    p = Path(path).expanduser()
    try:
        st = p.stat()
    except FileNotFoundError:
        raise ValueError(f"{p}: no such file") from None
    return _load(loader, str(p), st.st_mtime_ns, st.st_size)


def search_dirs() -> list[Path]:
    """Where artifacts are looked up: ``$VELOX_ARTIFACTS`` (in order), then ``~/.cache/velox``."""
    env = [Path(d).expanduser() for d in os.environ.get(ENV, "").split(":") if d]
    return [*env, Path("~/.cache/velox").expanduser()]


def find_artifact(
    fmt: str, fp: str, dirs: list[Path] | None = None, version: str | None = None
) -> Path | None:
    """The first ``*.safetensors`` file (directories in order, files sorted by name) of format
    ``fmt`` (and ``version``, when given) fitted for fingerprint ``fp``."""
    for d in search_dirs() if dirs is None else dirs:
        if not d.is_dir():
            continue
        for p in sorted(d.glob("*.safetensors")):
            try:
                meta = read_metadata(p)
            except ValueError:
                continue
            if meta.get("format") != fmt or meta.get("fingerprint") != fp:
                continue
            if version is None or meta.get("version") == version:
                return p
    return None


def resolve_artifact(
    model: Any,
    path: str | os.PathLike | None,
    *,
    fmt: str,
    version: str,
    what: str,
    how_to_fit: str,
    param: str,
    missing: type[Exception] = FileNotFoundError,
) -> Path:
    """The artifact to use for ``model``: ``path`` if given (checked), else the lookup.

    ``what`` names the method in messages (``"CommVQ"``), ``param`` the cache's
    parameter that takes a path (``"codebooks"``), ``how_to_fit`` the command that makes one.

    Raises:
        ValueError: ``path`` is not such an artifact, or was fitted for another model.
        missing: nothing in the search directories was fitted for this model.
    """
    fp = fingerprint(model)
    if path is not None:
        p = Path(path).expanduser()
        meta = read_metadata(p)
        check_format(p, meta, fmt, version, what)
        if meta.get("fingerprint") != fp:
            raise ValueError(
                f"{param}={str(path)!r} was fitted for another model (fingerprint "
                f"{meta.get('fingerprint')}, {meta.get('model')}); this model's fingerprint is "
                f"{fp} ({json.dumps(identity(model), sort_keys=True)}). Fit one for it: "
                f"{how_to_fit}"
            )
        return p
    found = find_artifact(fmt, fp, version=version)
    if found is None:
        where = ", ".join(str(d) for d in search_dirs())
        raise missing(
            f"no {what} artifact for this model (fingerprint {fp}) in {where}. It is fitted on "
            f"the model's own activations: fit one with `{how_to_fit}` and put FILE in "
            f"~/.cache/velox or a directory listed in ${ENV}, or pass {param}=FILE"
        )
    return found
