"""The bytes of a CacheGen cache: a header, then one frame per chunk, each with its checksum.

CacheGen sends a context as chunks that decode one by one as they arrive (arXiv 2310.07240,
Sec. 5.3), so the container is a sequence rather than one table of arrays::

    b"VXCGEN01"                                   8 bytes
    header length (uint32 LE), header (JSON), SHA-256 of the header
    per chunk: length (uint32 LE), chunk bytes (velox_cachegen.chunks), SHA-256 of them

The header (:mod:`velox_cachegen.header`) fixes the chunks' token spans in advance; each
chunk carries its own quality level, so a sender may pick every chunk's level as it goes.
:func:`split` refuses, with a ``ValueError``, anything but that exact layout: another magic,
a length that runs past the data, a checksum that does not match (a flipped byte), fewer
chunks than the header lists (a truncated file) or bytes after the last one.
"""

from __future__ import annotations

import hashlib
import json

__all__ = ["MAGIC", "frame", "head", "split"]

MAGIC = b"VXCGEN01"
_MAX_HEADER = 1 << 24


def _sha(data: bytes) -> bytes:
    return hashlib.sha256(data).digest()


def head(header: dict) -> bytes:
    """The magic and the framed header."""
    text = json.dumps(header, sort_keys=True, separators=(",", ":")).encode()
    return MAGIC + len(text).to_bytes(4, "little") + text + _sha(text)


def frame(chunk: bytes) -> bytes:
    """One chunk framed: its length, its bytes, their SHA-256."""
    return len(chunk).to_bytes(4, "little") + chunk + _sha(chunk)


def _read(data: bytes, at: int, what: str, limit: int) -> tuple[bytes, int]:
    if at + 4 > len(data):
        raise ValueError(f"truncated: {what} missing ({len(data) - at} bytes left)")
    n = int.from_bytes(data[at : at + 4], "little")
    if n > limit or at + 4 + n + 32 > len(data):
        raise ValueError(
            f"truncated: {what} of {n} bytes and its checksum run past the end "
            f"({len(data) - at - 4} bytes left)"
        )
    body = data[at + 4 : at + 4 + n]
    if data[at + 4 + n : at + 4 + n + 32] != _sha(body):
        raise ValueError(f"checksum mismatch in {what}: the bytes were altered")
    return body, at + 4 + n + 32


def split(data: bytes, chunks_of=None) -> tuple[dict, list[bytes]]:
    """The header (parsed JSON, unchecked: :mod:`velox_cachegen.header` checks it) and every
    chunk's bytes. ``chunks_of(header)`` gives how many chunks the header lists.

    Raises:
        ValueError: not a CacheGen cache, truncated, altered, or with trailing bytes.
    """
    if len(data) < len(MAGIC) or data[: len(MAGIC)] != MAGIC:
        raise ValueError("not a velox-cachegen cache (no VXCGEN01 magic at its start)")
    text, at = _read(data, len(MAGIC), "the header", _MAX_HEADER)
    try:
        header = json.loads(text)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"corrupt header: not JSON ({e})") from None
    n = chunks_of(header)
    chunks = []
    for i in range(n):
        body, at = _read(data, at, f"chunk {i} of {n}", len(data))
        chunks.append(body)
    if at != len(data):
        raise ValueError(f"{len(data) - at} bytes after the last chunk (altered or appended)")
    return header, chunks
