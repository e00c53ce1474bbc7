"""Reading CacheGen caches back: :func:`decode` (bytes), :func:`load` (a file),
:func:`inspect` (what a file holds).

The container's framing and checksums are checked first (:mod:`velox_cachegen.container`),
then every header field (:mod:`velox_cachegen.header`), then each chunk's fields against the
header (:mod:`velox_cachegen.chunks`), before a symbol is decoded. The decoded tokens go to
caches of the saved classes (:meth:`velox_core.stored.StoredTokens.build`): an mlx-lm
``KVCache`` gets them as they are, a velox cache is made again from its saved settings and
encodes them as a prefill would. Either continues decoding.
"""

from __future__ import annotations

import os
from typing import Any

import mlx.core as mx
import numpy as np

from velox_core.artifacts import fingerprint
from velox_core.stored import StoredTokens, read_file

from .chunks import SECTIONS, decode_chunks, read_meta
from .container import split
from .header import check, chunk_count, settings

__all__ = ["decode", "inspect", "load"]

_DTYPES = {"float16": mx.float16, "bfloat16": mx.bfloat16, "float32": mx.float32}


def _read(data: bytes) -> tuple[dict, list[bytes]]:
    header, frames = split(data, chunk_count)
    return check(header), frames


def decode(data: bytes, *, model: Any = None, return_metadata: bool = False):
    """Caches from :func:`velox_cachegen.encode`'s bytes.

    Args:
        model: checked against the fingerprint saved with the cache (when it was saved with
            one); velox caches are made through ``make_cache(model, ...)``.
        return_metadata: also return the metadata given at save time.

    Returns:
        one cache per layer (and the metadata dict if ``return_metadata``).

    Raises:
        ValueError: truncated, altered or crafted bytes, a cache of another model.
    """
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise TypeError(f"cachegen: decode takes bytes, got {type(data).__name__}")
    h, frames = _read(bytes(data))
    if (
        model is not None
        and h["fingerprint"] is not None
        and fingerprint(model) != h["fingerprint"]
    ):
        raise ValueError(
            f"cachegen: the cache was saved from another model (fingerprint {h['fingerprint']}, "
            f"this model's is {fingerprint(model)})"
        )
    st = settings(h)
    spans = [tuple(c) for c in h["chunks"]]
    try:
        parts = decode_chunks(frames, spans, st)
    except ValueError as e:
        raise ValueError(f"corrupt chunk: {e}") from None
    kv = []
    for i, ((heads, dk, dv), layer) in enumerate(zip(h["geometry"], h["layers"])):
        dt = _DTYPES[layer["dtype"]]
        pair = []
        for side, d in ((0, dk), (1, dv)):
            x = np.concatenate([p[2 * i + side] for p in parts], axis=1)  # (B, T, H*D)
            x = x.reshape(st.batch, h["tokens"], heads, d).transpose(0, 2, 1, 3)
            pair.append(mx.array(x).astype(dt))
        kv.append(tuple(pair))
    caches = StoredTokens(kv, h["layers"]).build(model, "cachegen")
    return (caches, dict(h["user"])) if return_metadata else caches


def load(path: str | os.PathLike, *, model: Any = None, return_metadata: bool = False):
    """Caches from a file written by :func:`velox_cachegen.save` (:func:`decode`'s
    arguments)."""
    return read_file(path, lambda data: decode(data, model=model, return_metadata=return_metadata))


def inspect(path: str | os.PathLike) -> dict[str, Any]:
    """What a CacheGen file holds, its header and framing checked (no model needed): batch,
    tokens, chunks with their levels and bytes, the layers' classes, the coding settings and
    the bytes by part against float16's."""

    def parse(data: bytes):
        h, frames = _read(data)
        return data, h, frames, [read_meta(f) for f in frames]

    data, h, frames, metas = read_file(path, parse)
    parts = {k: sum(len(sec[k]) for _, sec in metas) for k in SECTIONS}
    fp16 = 2 * h["batch"] * h["tokens"] * sum(hh * (dk + dv) for hh, dk, dv in h["geometry"])
    side = sum(v for k, v in parts.items() if k not in ("tables", "streams"))
    return {
        "batch": h["batch"],
        "tokens": h["tokens"],
        "chunks": [
            {"start": m["start"], "stop": m["stop"], "level": m["level"], "bytes": len(f)}
            for (m, _), f in zip(metas, frames)
        ],
        "layers": [x.get("method", x.get("class")) for x in h["layers"]],
        "settings": {k: h[k] for k in ("group", "anchor_step", "delta", "block")},
        "quality": h["quality"],
        "fingerprint": h["fingerprint"],
        "bytes": {
            "total": len(data),
            "streams": parts["streams"],
            "tables": parts["tables"],
            "side": side,
            "header": len(data) - side - parts["streams"] - parts["tables"],
            "fp16": fp16,
        },
        "x_fp16": fp16 / len(data),
        "user": h["user"],
    }
