"""Per-model artifacts: what a method fits once on a model (codebooks, filters, projections,
mappers) and finds again by the model's fingerprint.

An artifact is a safetensors file whose metadata holds at least ``format`` (``"velox-<method>"``),
``version`` and the ``fingerprint`` of the model it was fitted on (a method may also keep a
directory with a manifest; it uses :func:`fingerprint` the same way). A cache resolves its
model's artifact with :meth:`ArtifactKind.resolve`: an explicit path wins (checked: the right format
and version, fitted for this model); otherwise the directories of ``$VELOX_ARTIFACTS``
(colon-separated), then ``~/.cache/velox``, then the ``shared/artifacts`` that ships with velox
are searched (:func:`velox_core.environment.search_dirs`). A model without one is an error
that says how to fit it, never a random artifact.

The fingerprint is a SHA-256 over the model's identifying config (:func:`identity`) and, for
every parameter array (sorted by name), its name, shape and 257 evenly spaced entries (float
entries rounded to bfloat16, so casting a checkpoint between float32, float16 and bfloat16,
e.g. to run it in float32 on a CPU, keeps its fingerprint; integer entries, such as packed
quantized weights, as raw bytes). Another checkpoint (another model, a fine-tune, a
quantization) changes it; one model has one fingerprint whatever the method.

A method describes its artifact once, as an :class:`ArtifactKind` (format, version, names for
messages, and how its record becomes arrays and metadata and back), which saves, loads (with
its checks), finds and resolves its files; the method keeps only its arrays and its own
metadata fields. Every file of a kind carries ``layers`` (the JSON list of layer
indices), ``fingerprint``, ``model`` (:func:`identity`) and ``calibration`` (how it was fitted).
A method's record of a file derives from :class:`Fitted` (the provenance; :class:`FittedLayers`
adds the per-layer lookup); a codec that codes with one layer of a file mixes in
:class:`LayerFit`. A fit takes its calibration as a :class:`Calibration` (the token ids,
:func:`calibration_ids`, and the model run on them, :func:`prefilled`: both from
:mod:`velox_core.calibration`) and ends with :func:`fitted` (the provenance of a fit made now).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import struct
from collections.abc import Callable, Iterator
from dataclasses import KW_ONLY, dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any, ClassVar, TypeVar

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten

from .calibration import calibration_ids, model_dtype, prefilled, token_stream
from .environment import search_dirs
from .validation import check_int, check_path

__all__ = [
    "ArtifactFile",
    "ArtifactKind",
    "Fitted",
    "FittedLayers",
    "bound_layer",
    "calibration_ids",
    "fingerprint",
    "fitted",
    "identity",
    "load_cached",
    "prefilled",
    "read_metadata",
    "token_stream",
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
    the artifact in the message (the method's name)."""
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


@dataclass
class ArtifactFile:
    """An artifact as read from its file: metadata strings and arrays (no checks of its own)."""

    path: Path
    meta: dict[str, str]
    arrays: dict[str, mx.array]

    def json(self, name: str) -> Any:
        """The metadata field ``name``, JSON-decoded."""
        return json.loads(self.meta[name])

    @property
    def layers(self) -> list[int]:
        """The layer indices the file holds."""
        return [int(i) for i in self.json("layers")]

    def per_layer(self, name: str, cast: Callable[[Any], Any]) -> dict[int, list[Any]]:
        """A metadata field of one list per layer, ``{"<i>": [...]}``, each entry cast."""
        return {int(i): [cast(x) for x in v] for i, v in self.json(name).items()}

    def provenance(self) -> dict[str, Any]:
        """``fingerprint``, ``model`` and ``calibration``, as keyword arguments."""
        return {
            "fingerprint": self.meta["fingerprint"],
            "model": self.json("model"),
            "calibration": self.json("calibration"),
        }


@dataclass
class Fitted:
    """What the record of every fitted artifact shares, as a base of a method's dataclass:
    the provenance, ``fingerprint`` and ``model`` and ``calibration`` (dicts, empty by
    default), keyword-only fields after the method's own. A record with a file
    (:class:`ArtifactKind`) defines ``encode(self) -> (arrays, metadata)`` (its own fields,
    beyond the provenance) and the classmethod ``decode(file) -> record`` (an
    :class:`ArtifactFile`); ``noun`` names it in errors (``save_<noun>``)."""

    noun: ClassVar[str] = "artifact"
    _: KW_ONLY
    fingerprint: str
    model: dict[str, Any] = field(default_factory=dict)
    calibration: dict[str, Any] = field(default_factory=dict)

    def check(self, where: str) -> None:
        """Raise ``ValueError`` naming ``where`` if the record is inconsistent (none here)."""

    def provenance(self) -> dict[str, Any]:
        """``fingerprint``, ``model`` and ``calibration``: the metadata every file carries."""
        return {
            "fingerprint": self.fingerprint,
            "model": self.model,
            "calibration": self.calibration,
        }


class FittedLayers(Fitted):
    """A :class:`Fitted` record whose ``layers`` maps layer index -> that layer's arrays;
    ``what`` names them in messages (``"<method> codebooks"``)."""

    what: ClassVar[str] = "fitted artifacts"
    layers: dict[int, Any]

    def layer(self, i: int) -> Any:
        """``layers[i]``, or ``ValueError`` naming the layers that were fitted."""
        if i not in self.layers:
            raise ValueError(f"these {self.what} have no layer {i} (fitted: {sorted(self.layers)})")
        return self.layers[i]


def bound_layer(obj: Any, model: Any, layer: int | None) -> bool:
    """``bind(model, layer)``'s first step for a codec or policy that uses one layer of a
    model's artifact: ``layer``, when given, is checked (an int >= 0) and set as
    ``obj.layer``; returns True when ``model`` and a layer are both known (the artifact's
    layer can be looked up), False when ``bind`` has nothing more to do."""
    if layer is not None:
        obj.layer = check_int("layer", layer, minimum=0)
    return model is not None and obj.layer is not None


def fitted(model: Any, how: str, source: str | None, **calibration: Any) -> dict[str, Any]:
    """The provenance keyword arguments of an artifact fitted on ``model`` now:
    ``fingerprint``, ``model`` (:func:`identity`) and ``calibration``, which holds the fit's
    own ``calibration`` entries and ``input`` (``how``, from :func:`calibration_ids`),
    ``source`` (a description of the calibration text, ``""`` for none) and ``dtype``
    (:func:`model_dtype`)."""
    return {
        "fingerprint": fingerprint(model),
        "model": identity(model),
        "calibration": {
            **calibration,
            "input": how,
            "source": source or "",
            "dtype": model_dtype(model),
        },
    }


@dataclass(frozen=True)
class Calibration:
    """A fit's calibration, as every fit takes it: the token ids and how they were given
    (:func:`calibration_ids`), sequences of ``seq_len`` tokens prefilled ``chunk`` at a time
    (:func:`prefilled`) and ``source``, a description of the text (kept in the artifact)."""

    ids: np.ndarray
    how: str
    seq_len: int
    chunk: int
    source: str | None = None

    @classmethod
    def of(
        cls,
        tokens: Any,
        text: str | list[str] | None,
        who: str,
        max_tokens: int | None,
        seq_len: int,
        chunk: int,
        source: str | None,
        min_seq_len: int = 1,
    ) -> Calibration:
        """The calibration of fit ``who`` from its arguments (``tokens``: a tokenizer, with
        ``text``, or token ids), checked: ``seq_len`` >= ``min_seq_len``, ``chunk`` >= 1."""
        ids, how = calibration_ids(tokens, text, who, max_tokens)
        check_int("seq_len", seq_len, minimum=min_seq_len)
        return cls(ids, how, seq_len, check_int("chunk", chunk, minimum=1), source)

    def prefilled(self, model: Any) -> Iterator[tuple[mx.array, list[tuple[int, Any]]]]:
        """:func:`prefilled` over these tokens."""
        return prefilled(model, self.ids, self.seq_len, self.chunk)

    def fitted(self, model: Any, **calibration: Any) -> dict[str, Any]:
        """:func:`fitted` of a fit on these tokens, its ``calibration`` entries ``tokens``,
        ``seq_len`` and the fit's own ``calibration``."""
        extra = {"tokens": int(self.ids.size), "seq_len": self.seq_len, **calibration}
        return fitted(model, self.how, self.source, **extra)


@dataclass(frozen=True)
class ArtifactKind:
    """One method's artifact file: per-layer arrays plus a header, fingerprinted.

    ``fmt`` and ``version`` go in its metadata, ``what`` names it in messages (the method's
    name), ``param`` is the cache parameter that takes its path (``"codebooks"``),
    ``how_to_fit`` the command that makes one (by default the method package's own, ``python
    -m velox_<method> fit --model PATH --text CALIBRATION.txt --out FILE``), ``missing`` the
    error raised when a model has none and ``record`` the method's :class:`Fitted` class,
    which turns a record into arrays and metadata (``encode``), a file back into a record
    (``decode``) and checks one (``check``, before a save and after a load)."""

    fmt: str
    version: str
    what: str
    param: str
    how_to_fit: str = ""
    missing: type[Exception] = FileNotFoundError
    record: type[Fitted] | None = None

    def __post_init__(self) -> None:
        if not self.how_to_fit:
            command = f"python -m velox_{self.fmt.removeprefix('velox-')} fit"
            how = f"{command} --model PATH --text CALIBRATION.txt --out FILE"
            object.__setattr__(self, "how_to_fit", how)

    def save(self, record: Any, path: str | os.PathLike) -> Path:
        """Write ``record`` to ``path`` (``.safetensors``; parent directories are created):
        its arrays, this kind's format and version, ``layers``, its provenance and its own
        metadata.

        Raises:
            ValueError: an inconsistent record, no layers, another file suffix.
        """
        who = f"save_{record.noun}"
        record.check(who)
        arrays, own = record.encode()
        path = Path(path).expanduser()
        if path.suffix != ".safetensors":
            raise ValueError(f"{who}: the file name must end in .safetensors, got {path}")
        if not record.layers:
            raise ValueError(f"{who}: no layers to save")
        fields = {"format": self.fmt, "version": self.version, "layers": sorted(record.layers)}
        fields |= {**record.provenance(), **own}
        text = {
            k: v if isinstance(v, str) else json.dumps(v, sort_keys=True) for k, v in fields.items()
        }
        path.parent.mkdir(parents=True, exist_ok=True)
        mx.save_safetensors(str(path), arrays, text)
        return path

    def load(self, path: str | os.PathLike) -> Any:
        """The record of the artifact at ``path``: its format and version checked, decoded, then
        checked; a missing field or array, or one of the wrong type, is reported as a corrupt
        artifact.

        Raises:
            ValueError: no such file, not a safetensors file, another format or version, or
                corrupt.
        """
        path = Path(path).expanduser()
        if self.record is None:
            raise TypeError(f"{self.what} artifacts: this ArtifactKind has no record class")
        meta = read_metadata(path)
        check_format(path, meta, self.fmt, self.version, self.what)
        try:
            out = self.record.decode(ArtifactFile(path, meta, mx.load(str(path))))
        except (KeyError, TypeError, ValueError, RuntimeError) as e:
            raise ValueError(f"{path}: corrupt {self.what} artifact ({e})") from None
        out.check(str(path))
        return out

    def load_cached(self, path: str | os.PathLike) -> Any:
        """:meth:`load`, read once per file version (the caches of every layer share it)."""
        return load_cached(self.load, path)

    def find(self, fp: str, dirs: list[Path] | None = None) -> Path | None:
        """The first file of this kind (directories in order, files sorted by name) fitted for
        fingerprint ``fp``."""
        for d in search_dirs() if dirs is None else dirs:
            for p in sorted(d.glob("*.safetensors")) if d.is_dir() else ():
                try:
                    meta = read_metadata(p)
                except ValueError:
                    continue
                want = (self.fmt, self.version, fp)
                if (meta.get("format"), meta.get("version"), meta.get("fingerprint")) == want:
                    return p
        return None

    def unbound(self, noun: str, how: str) -> ValueError:
        """The error of a cache with no artifact of this kind to read and no model to find one
        by: ``noun`` names what the method reads (``"codebooks"``), ``how`` what it does with
        it (``"the method codes keys only with codebooks"``, followed by "fitted on the model")."""
        method = self.fmt.removeprefix("velox-")
        return ValueError(
            f"{method}: no {noun} for this cache; {how} fitted on the model (python -m "
            f"velox_{method} fit ...). Make caches with velox_core.make_cache(model, ...), which "
            f"finds the model's artifact, or pass {self.param}=PATH and layer=i"
        )

    def resolve(self, model: Any, path: str | os.PathLike | None = None) -> Path:
        """The artifact of this kind for ``model``: ``path`` if given (checked: this kind,
        fitted for this model), else the first found by the model's fingerprint in
        :func:`~velox_core.environment.search_dirs`.

        Raises:
            ValueError: ``path`` is not such an artifact, or was fitted for another model.
            self.missing: nothing in the search directories was fitted for this model.
        """
        fp = fingerprint(model)
        if path is not None:
            p = Path(path).expanduser()
            meta = read_metadata(p)
            check_format(p, meta, self.fmt, self.version, self.what)
            if meta.get("fingerprint") != fp:
                raise ValueError(
                    f"{self.param}={str(path)!r} was fitted for another model (fingerprint "
                    f"{meta.get('fingerprint')}, {meta.get('model')}); this model's fingerprint "
                    f"is {fp} ({json.dumps(identity(model), sort_keys=True)}). Fit one for it: "
                    f"{self.how_to_fit}"
                )
            return p
        found = self.find(fp)
        if found is None:
            where = ", ".join(str(d) for d in search_dirs())
            raise self.missing(
                f"no {self.what} artifact for this model (fingerprint {fp}) in {where}. It is "
                f"fitted on the model's own activations: fit one with `{self.how_to_fit}` and "
                f"put FILE in ~/.cache/velox or a directory listed in ${ENV}, or pass "
                f"{self.param}=FILE"
            )
        return found


class LayerFit:
    """What a codec that codes with one layer of its model's artifact keeps (velox-palu,
    velox-spectral, velox-oscar): ``artifact`` (a path, or None: the model's, found by
    :meth:`found` at ``bind``) and ``layer``, settings; ``_path``, the file given or found;
    ``_fit``, the layer's arrays once read. ``kind`` is the method's :class:`ArtifactKind`;
    ``needs_artifact`` whether the codec reads one at all."""

    kind: ClassVar[ArtifactKind]
    needs_artifact: bool = True

    def init_fit(self, artifact: str | os.PathLike | None, layer: int | None) -> None:
        """Check and set ``artifact`` and ``layer``; nothing is read yet."""
        self.artifact = check_path("artifact", artifact)
        self.layer = None if layer is None else check_int("layer", layer, minimum=0)
        self._path = self.artifact
        self._fit: dict[str, mx.array] | None = None

    def fresh(self):
        """An empty copy that keeps what ``bind`` found and the fitted arrays once read (the
        model's, not the sequence's: a loaded cache needs no artifact for its fresh copies)."""
        out = type(self).from_config(self.config())
        out._path, out._fit = self._path, self._fit
        return out

    def found(self, model: Any, layer: int | None) -> Any:
        """``bind``'s search: the record of the artifact fitted for ``model`` (the
        ``artifact`` setting if given, checked), read now so that a missing or wrong one
        fails at ``bind``, not at first use; None where ``bind`` has nothing to read (no
        model or no layer, or no artifact needed). The arrays read before are dropped."""
        if not bound_layer(self, model, layer) or not self.needs_artifact:
            return None
        self._path, self._fit = str(self.kind.resolve(model, self.artifact)), None
        return self.kind.load_cached(self._path)

    def record(self, noun: str, how: str) -> Any:
        """The record of the artifact given or found, for a codec that has not read its
        arrays yet; without one, :meth:`ArtifactKind.unbound`'s error (``noun``, ``how``)."""
        if self._path is None or self.layer is None:
            raise self.kind.unbound(noun, how)
        return self.kind.load_cached(self._path)
