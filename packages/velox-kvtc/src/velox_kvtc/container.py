"""The bytes of a KVTC file: the safetensors layout, written and read strictly.

A KVTC cache is bytes first (:func:`velox_kvtc.encode`, for the wire) and a file second
(:func:`velox_kvtc.save` writes those bytes), so the container is built here rather than
through ``mx.save_safetensors`` (which writes files only): an 8-byte little-endian header
length, a JSON header (each array's ``dtype``, ``shape`` and ``data_offsets``, and the
``__metadata__`` strings) and the arrays' bytes, back to back in name order. Any safetensors
reader opens it. :func:`unpack` refuses, with a ``ValueError``, everything but that exact
layout: a header longer than the data or than 64 MiB, unknown dtypes, offsets that overlap,
leave gaps or trailing bytes, sizes that disagree with shapes, metadata that is not strings.
"""

from __future__ import annotations

import json
import struct

import mlx.core as mx
import numpy as np

__all__ = ["from_numpy", "pack", "to_numpy", "unpack"]

_MAX_HEADER = 1 << 26
_NUMPY = {"F16": np.float16, "F32": np.float32, "BF16": np.uint16, "U8": np.uint8}
_TAGS = {mx.float16: "F16", mx.float32: "F32", mx.bfloat16: "BF16", mx.uint8: "U8"}


def to_numpy(a: mx.array) -> tuple[str, np.ndarray]:
    """``(tag, array)``: the safetensors dtype tag and the array's bytes as numpy (bfloat16
    as its uint16 bit patterns)."""
    tag = _TAGS.get(a.dtype)
    if tag is None:
        raise ValueError(f"kvtc: cannot store an array of dtype {a.dtype}")
    a = mx.contiguous(a)
    return tag, np.array(a.view(mx.uint16) if tag == "BF16" else a)


def from_numpy(tag: str, a: np.ndarray) -> mx.array:
    """Inverse of :func:`to_numpy`."""
    out = mx.array(a)
    return out.view(mx.bfloat16) if tag == "BF16" else out


def pack(arrays: dict[str, tuple[str, np.ndarray]], metadata: dict[str, str]) -> bytes:
    """The safetensors bytes of ``arrays`` (name -> ``(tag, array)``) and ``metadata``."""
    header: dict[str, object] = {"__metadata__": metadata}
    blobs, at = [], 0
    for name in sorted(arrays):
        tag, a = arrays[name]
        data = np.ascontiguousarray(a, dtype=_NUMPY[tag]).tobytes()
        header[name] = {"dtype": tag, "shape": list(a.shape), "data_offsets": [at, at + len(data)]}
        blobs.append(data)
        at += len(data)
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # the data starts 8-byte aligned, as safetensors pads
    return struct.pack("<Q", len(text)) + text + b"".join(blobs)


def _entry(name: str, e: object, size: int) -> tuple[str, tuple[int, ...], int, int]:
    if not isinstance(e, dict) or set(e) != {"dtype", "shape", "data_offsets"}:
        raise ValueError(f"array {name!r} has a malformed entry")
    tag, shape, offsets = e["dtype"], e["shape"], e["data_offsets"]
    if tag not in _NUMPY:
        raise ValueError(f"array {name!r} has dtype {tag!r} (allowed: {', '.join(_NUMPY)})")
    ints = lambda xs: all(isinstance(x, int) and not isinstance(x, bool) for x in xs)  # noqa: E731
    if not isinstance(shape, list) or not ints(shape) or any(x < 0 for x in shape):
        raise ValueError(f"array {name!r} has a bad shape {shape!r}")
    if not isinstance(offsets, list) or len(offsets) != 2 or not ints(offsets):
        raise ValueError(f"array {name!r} has bad data_offsets {offsets!r}")
    a, b = offsets
    want = int(np.prod(shape, dtype=np.int64)) * np.dtype(_NUMPY[tag]).itemsize
    if not 0 <= a <= b <= size or b - a != want:
        raise ValueError(f"array {name!r}: offsets {offsets} do not hold a {tag} {shape} array")
    return tag, tuple(shape), a, b


def unpack(data: bytes) -> tuple[dict[str, tuple[str, np.ndarray]], dict[str, str]]:
    """Inverse of :func:`pack`; ``ValueError`` for anything else (module docstring)."""
    if len(data) < 8:
        raise ValueError(f"{len(data)} bytes: too short for a safetensors header")
    (n,) = struct.unpack("<Q", data[:8])
    if n > min(_MAX_HEADER, len(data) - 8):
        raise ValueError(f"a header of {n} bytes in {len(data)} bytes (truncated or not KVTC)")
    try:
        header = json.loads(data[8 : 8 + n])
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"the header is not JSON ({e})") from None
    if not isinstance(header, dict):
        raise ValueError("the header is not a JSON object")
    meta = header.pop("__metadata__", {})
    if not isinstance(meta, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in meta.items()
    ):
        raise ValueError("the metadata must map strings to strings")
    body = memoryview(data)[8 + n :]
    entries = sorted(
        ((name, *_entry(name, e, len(body))) for name, e in header.items()), key=lambda x: x[3]
    )
    at, out = 0, {}
    for name, tag, shape, a, b in entries:
        if a != at:
            raise ValueError(f"array {name!r} starts at {a}, expected {at} (gap or overlap)")
        out[name] = (tag, np.frombuffer(body[a:b], dtype=_NUMPY[tag]).reshape(shape).copy())
        at = b
    if at != len(body):
        raise ValueError(f"{len(body) - at} bytes after the last array (truncated or altered)")
    return out, meta
