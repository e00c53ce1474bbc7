"""The records of the per-layer allocator (:mod:`velox_cli.allocator`): what
:func:`~velox_cli.allocator.sensitivity` measured (:class:`SensitivityTable`) and what
:func:`~velox_cli.allocator.allocate` chose (:class:`Allocation`), each with its JSON file.

An allocation file is what ``velox allocate --json`` writes and ``velox bench`` / ``velox eval``
take in place of a spec: ``{"default": SPEC, "layers": {"0": SPEC, ...}}`` and the predicted
totals; one written by hand needs only ``default`` and ``layers``.
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, TypeVar

__all__ = ["Allocation", "SensitivityTable"]

TABLE_FORMAT = "velox-sensitivity"
PLAN_FORMAT = "velox-allocation"
VERSION = 1

_R = TypeVar("_R", bound="_Record")


class _Record:
    """A record with its JSON file (``to_json`` / ``from_json``): :meth:`save` writes it,
    :meth:`load` reads it back; ``noun`` names the record in errors."""

    noun: ClassVar[str]

    def save(self, path: str | os.PathLike) -> None:
        Path(path).write_text(json.dumps(self.to_json(), indent=1) + "\n")

    @classmethod
    def load(cls: type[_R], path: str | os.PathLike) -> _R:
        return cls.from_json(_read_json(path, cls.noun))

    @classmethod
    def _of(cls: type[_R], **fields: Any) -> _R:
        """The record of a document's fields; an unknown or missing field is a
        ``ValueError`` naming the record."""
        try:
            return cls(**fields)
        except TypeError as e:
            raise ValueError(f"{cls.noun}: {e}") from None


@dataclass
class SensitivityTable(_Record):
    """What :func:`~velox_cli.allocator.sensitivity` measured: for each allocated layer
    (``layers``, model layer indices) and candidate spec (``specs``), ``damage[l][s]`` the mean
    KL and ``held[l][s]`` / ``resident[l][s]`` the layer's held / resident (``nbytes``,
    capacity included) bytes per token; None where the spec does not serve the layer.
    ``base[l]``: the base cache's held bytes per token; ``elements[l]``: key and value
    channels per token (KV heads times key dim plus value dim). ``tokens``: tokens each
    prompt's caches held; ``info``: free provenance.
    """

    specs: list[str]
    layers: list[int]
    damage: list[list[float | None]]
    held: list[list[float | None]]
    resident: list[list[float | None]]
    base: list[float]
    elements: list[int]
    prompts: int
    tail: int
    tokens: int
    info: dict[str, Any] = field(default_factory=dict)

    noun: ClassVar[str] = "sensitivity table"

    def __post_init__(self) -> None:
        n, s = len(self.layers), len(self.specs)
        if not n or not s:
            raise ValueError("a sensitivity table needs at least one layer and one spec")
        if len(set(self.specs)) != s or len(set(self.layers)) != n:
            raise ValueError("a sensitivity table's specs and layers must each be distinct")
        for name in ("damage", "held", "resident"):
            rows = getattr(self, name)
            if len(rows) != n or any(len(r) != s for r in rows):
                raise ValueError(f"sensitivity table: {name} must be {n} layers x {s} specs")
        for name in ("base", "elements"):
            if len(getattr(self, name)) != n:
                raise ValueError(f"sensitivity table: {name} must have one entry per layer")
        for r_d, r_h in zip(self.damage, self.held, strict=True):
            for d, h in zip(r_d, r_h, strict=True):
                if (d is None) != (h is None):
                    raise ValueError("sensitivity table: damage and bytes must be None together")
                if h is not None and not (math.isfinite(h) and h >= 0):
                    raise ValueError(f"sensitivity table: bytes must be finite and >= 0, got {h}")

    def to_json(self) -> dict[str, Any]:
        return {"format": TABLE_FORMAT, "version": VERSION, **self.__dict__}

    @classmethod
    def from_json(cls, doc: Any) -> SensitivityTable:
        if not isinstance(doc, dict) or doc.get("format") != TABLE_FORMAT:
            raise ValueError(f"not a sensitivity table (format {TABLE_FORMAT!r} expected)")
        if doc.get("version") != VERSION:
            raise ValueError(f"sensitivity table version {doc.get('version')!r}, read {VERSION}")
        return cls._of(**{k: v for k, v in doc.items() if k not in ("format", "version")})


@dataclass
class Allocation(_Record):
    """One spec per layer: ``layers`` ({model layer index: spec}) is
    :func:`velox_core.make_cache`'s ``layers`` argument; ``default`` the spec most layers got
    (for the layers the table does not hold, which keep the model's own cache wherever no
    candidate serves them). ``bytes_per_token`` and ``damage``: the predicted totals (sums of
    the chosen held bytes per token and KLs); ``budget``: bytes per token allowed (None in a
    file written by hand, which needs only ``default`` and ``layers``)."""

    layers: dict[int, str]
    default: str
    bytes_per_token: float | None = None
    damage: float | None = None
    budget: float | None = None
    specs: list[str] = field(default_factory=list)
    info: dict[str, Any] = field(default_factory=dict)

    noun: ClassVar[str] = "allocation"

    def to_json(self) -> dict[str, Any]:
        out = {"format": PLAN_FORMAT, "version": VERSION, **self.__dict__}
        out["layers"] = {str(k): v for k, v in self.layers.items()}
        return out

    @classmethod
    def from_json(cls, doc: Any) -> Allocation:
        """An allocation from its JSON: ``default`` (a spec) and ``layers`` ({"index": spec})
        are needed; ``format`` and ``version``, where given, must be this module's."""
        if not isinstance(doc, dict):
            raise ValueError("an allocation must be a JSON object with 'default' and 'layers'")
        if doc.get("format", PLAN_FORMAT) != PLAN_FORMAT:
            raise ValueError(f"not an allocation (format {PLAN_FORMAT!r} expected)")
        if doc.get("version", VERSION) != VERSION:
            raise ValueError(f"allocation version {doc.get('version')!r}; this velox reads 1")
        layers = doc.get("layers")
        if not isinstance(layers, dict):
            raise ValueError("allocation: 'layers' must map layer indices to specs")
        out: dict[int, str] = {}
        for k, v in layers.items():
            if not (isinstance(k, str) and re.fullmatch(r"-?\d+", k)) or not isinstance(v, str):
                raise ValueError(f"allocation: layer {k!r}: {v!r} is not 'index': 'spec'")
            out[int(k)] = v
        if not isinstance(doc.get("default"), str):
            raise ValueError("allocation: 'default' must be a spec string")
        for name in ("bytes_per_token", "damage", "budget"):
            v = doc.get(name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float))):
                raise ValueError(f"allocation: {name!r} must be a number, got {v!r}")
        fields = {k: v for k, v in doc.items() if k not in ("format", "version", "layers")}
        return cls._of(layers=out, **fields)


def _read_json(path: str | os.PathLike, what: str) -> Any:
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"{what}: no such file {str(path)!r}")
    try:
        return json.loads(p.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{what} {str(path)!r} is not JSON: {e}") from None
