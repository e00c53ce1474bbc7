"""The header of a KVTC cache: its checksum, and every field checked before it is used.

:func:`read` takes the bytes of a cache (:mod:`velox_kvtc.container`) and returns its arrays
and a :class:`Header` whose fields have the types and ranges a cache written by
:func:`velox_kvtc.encode` has, and whose arrays are exactly those the header implies (names,
dtypes, shapes): a crafted file that passes the checksum is still refused, with a
``ValueError`` naming the field, before anything is decoded.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any

import numpy as np

from velox_core.stored import StoredTokens, header_int, header_user

from .allocation import Plan
from .container import unpack

__all__ = ["DTYPES", "FORMAT", "VERSION", "Header", "digest", "read"]

FORMAT = "velox-kvtc-cache"
VERSION = "1"
DTYPES = {"float16": "F16", "bfloat16": "BF16", "float32": "F32"}  # exact tokens' dtypes
_SIDES = ("key", "value")
_FIELDS = {
    "fingerprint",
    "basis_id",
    "basis_bytes",
    "ratio",
    "plans",
    "batch",
    "tokens",
    "sinks",
    "window",
    "layers",
    "user",
}


@dataclass(frozen=True)
class Header:
    """A cache's header, checked (:func:`read`)."""

    fingerprint: str
    basis_id: str
    basis_bytes: int
    ratio: str
    plans: dict[str, Plan]
    batch: int
    tokens: int
    sinks: int
    window: int
    layers: list[dict[str, Any]]
    user: dict[str, str]

    @property
    def rows(self) -> int:
        """Coded rows per side: every batch row's positions between sinks and window."""
        return self.batch * (self.tokens - self.sinks - self.window)


def digest(arrays: dict[str, tuple[str, np.ndarray]], header: str) -> str:
    """SHA-256 over the format, version, header text and every array (name, dtype, shape,
    bytes)."""
    h = hashlib.sha256(f"{FORMAT}|{VERSION}|{len(header)}:".encode() + header.encode())
    for name in sorted(arrays):
        tag, a = arrays[name]
        h.update(f"{name}|{tag}|{tuple(a.shape)}|".encode())
        h.update(np.ascontiguousarray(a).tobytes())
    return h.hexdigest()


def _str(h: dict, name: str) -> str:
    if not isinstance(h[name], str) or not h[name]:
        raise ValueError(f"corrupt header: {name} must be a non-empty string, got {h[name]!r}")
    return h[name]


def _check_arrays(arrays: dict[str, tuple[str, np.ndarray]], h: Header) -> None:
    want = {f"{s}.{part}" for s in _SIDES for part in ("codes", "scales")}
    want |= {f"exact.{i}.{s}" for i in range(len(h.layers)) for s in _SIDES}
    if set(arrays) != want:
        extra, missing = sorted(set(arrays) - want), sorted(want - set(arrays))
        raise ValueError(f"corrupt file: arrays {extra} unexpected, {missing} missing")
    for s in _SIDES:
        for part in ("codes", "scales"):
            tag, a = arrays[f"{s}.{part}"]
            if tag != "U8" or a.ndim != 1:
                raise ValueError(f"corrupt file: {s}.{part} must be a uint8 stream")
    for i, layer in enumerate(h.layers):
        for s in _SIDES:
            tag, a = arrays[f"exact.{i}.{s}"]
            if tag != DTYPES[layer["dtype"]] or a.ndim != 4:
                raise ValueError(
                    f"corrupt file: exact.{i}.{s} is not a {layer['dtype']} (B, H, T, D) array"
                )
            if a.shape[0] != h.batch or a.shape[2] != h.sinks + h.window:
                raise ValueError(
                    f"corrupt file: exact.{i}.{s} has shape {a.shape}, the header a batch of "
                    f"{h.batch} and {h.sinks + h.window} exact tokens"
                )


def read(data: bytes) -> tuple[dict[str, tuple[str, np.ndarray]], Header]:
    """Arrays and checked header of a cache's bytes.

    Raises:
        ValueError: not a KVTC cache, another version, a checksum mismatch, a malformed field.
    """
    try:
        arrays, meta = unpack(data)
    except ValueError as e:
        raise ValueError(f"not a KVTC cache ({e})") from None
    if meta.get("format") != FORMAT:
        raise ValueError(f"not a KVTC cache (format {meta.get('format')!r})")
    if meta.get("version") != VERSION:
        raise ValueError(
            f"unsupported KVTC cache version {meta.get('version')!r} (this velox-kvtc reads "
            f"{VERSION})"
        )
    text = meta.get("kvtc", "")
    if digest(arrays, text) != meta.get("sha256"):
        raise ValueError("checksum mismatch: the bytes were altered or truncated")
    try:
        raw = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"corrupt header ({e})") from None
    if not isinstance(raw, dict) or set(raw) != _FIELDS:
        got = sorted(raw) if isinstance(raw, dict) else type(raw).__name__
        raise ValueError(f"corrupt header: fields {got}, expected {sorted(_FIELDS)}")
    plans = raw["plans"]
    if not isinstance(plans, dict) or set(plans) != set(_SIDES):
        raise ValueError("corrupt header: plans must hold a key plan and a value plan")
    layers = StoredTokens.check_records(raw["layers"], "corrupt header")
    user = header_user(raw)
    h = Header(
        _str(raw, "fingerprint"),
        _str(raw, "basis_id"),
        header_int(raw, "basis_bytes", 0),
        _str(raw, "ratio"),
        {s: Plan.from_json(plans[s], f"corrupt header: plans.{s}") for s in _SIDES},
        header_int(raw, "batch", 1),
        header_int(raw, "tokens", 1),
        header_int(raw, "sinks", 0),
        header_int(raw, "window", 0),
        layers,
        user,
    )
    if h.sinks + h.window > h.tokens:
        raise ValueError(
            f"corrupt header: sinks {h.sinks} + window {h.window} exceed tokens {h.tokens}"
        )
    _check_arrays(arrays, h)
    return arrays, h
