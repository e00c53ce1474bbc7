"""Reading KVTC caches back: :func:`decode` (bytes), :func:`load` (a file), :func:`inspect`.

The header is checked first (:mod:`velox_kvtc.header`), then the basis: the one given, or
the artifact in ``$VELOX_ARTIFACTS``, ``~/.cache/velox`` or the shipped artifacts whose
``basis_id`` is the file's. Its geometry and plan must be the file's. The coded rows are
decoded (:mod:`velox_kvtc.codec`), their keys rotated back at their positions, placed between
the exact sinks and window, and handed to caches of the saved classes
(:func:`velox_kvtc.features.build_caches`).
"""

from __future__ import annotations

import os
from typing import Any

import mlx.core as mx

from velox_core.artifacts import fingerprint, read_metadata, search_dirs
from velox_core.stored import read_file

from . import artifact as art
from .codec import Coded, decode_rows
from .container import from_numpy
from .features import build_caches, from_rows
from .header import Header, read

__all__ = ["decode", "inspect", "load"]


def _find(h: Header) -> art.KvtcBasis:
    for d in search_dirs():
        if not d.is_dir():
            continue
        for p in sorted(d.glob("*.safetensors")):
            try:
                meta = read_metadata(p)
            except ValueError:
                continue
            if meta.get("format") == art.FORMAT and meta.get("basis_id") == h.basis_id:
                return art.load_basis_cached(p)
    where = ", ".join(str(d) for d in search_dirs())
    raise art.MissingBasisError(
        f"kvtc: no KVTC basis {h.basis_id[:16]}... (fitted for the model of fingerprint "
        f"{h.fingerprint}) in {where}; pass basis= (the artifact the cache was saved with)"
    )


def _basis_for(h: Header, basis: Any) -> art.KvtcBasis:
    if basis is None:
        b = _find(h)
    elif isinstance(basis, art.KvtcBasis):
        b = basis
    elif isinstance(basis, (str, os.PathLike)):
        b = art.load_basis_cached(basis)
    else:
        raise TypeError(f"kvtc: basis must be a KvtcBasis or a file path, got {basis!r}")
    if b.basis_id != h.basis_id:
        raise ValueError(
            f"kvtc: the cache was coded with basis {h.basis_id[:16]}..., the basis given is "
            f"{b.basis_id[:16]}... (another fit); pass the artifact it was saved with"
        )
    return b


def _check_against(arrays: dict, h: Header, b: art.KvtcBasis) -> None:
    geo = [b.geometry[i] for i in b.layers]
    if len(h.layers) != len(geo):
        raise ValueError(f"corrupt file: {len(h.layers)} layers, the basis has {len(geo)}")
    for i, (hh, dk, dv) in enumerate(geo):
        for side, d in (("key", dk), ("value", dv)):
            shape = arrays[f"exact.{i}.{side}"][1].shape
            if (shape[1], shape[3]) != (hh, d):
                raise ValueError(f"corrupt file: exact.{i}.{side} has shape {shape}")
    for side, plan in h.plans.items():
        if plan != b.plan(h.ratio, side):
            raise ValueError(f"corrupt header: the {side} plan is not the basis's for {h.ratio}")


def decode(data: bytes, *, basis: Any = None, model: Any = None, return_metadata: bool = False):
    """Caches from :func:`velox_kvtc.encode`'s bytes.

    Args:
        basis: the :class:`~velox_kvtc.KvtcBasis` (or its file) the bytes were coded with;
            default: found by its ``basis_id`` (module docstring).
        model: checked against the file's fingerprint; velox caches are made through
            ``make_cache(model, ...)`` (which binds codecs that need the model).
        return_metadata: also return the metadata given at save time.

    Returns:
        one cache per layer (and the metadata dict if ``return_metadata``).

    Raises:
        ValueError: corrupt or crafted bytes, another model, another basis.
        MissingBasisError: no basis given and none found.
    """
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise TypeError(f"kvtc: decode takes bytes, got {type(data).__name__}")
    arrays, h = read(bytes(data))
    if model is not None and fingerprint(model) != h.fingerprint:
        raise ValueError(
            f"kvtc: the cache was saved from another model (fingerprint {h.fingerprint}, "
            f"this model's is {fingerprint(model)})"
        )
    b = _basis_for(h, basis)
    _check_against(arrays, h, b)
    rows = []
    for side in art.SIDES:
        coded = Coded(arrays[f"{side}.codes"][1].tobytes(), arrays[f"{side}.scales"][1].tobytes())
        rows.append(decode_rows(coded, h.rows, b.means[side], b.bases[side], h.plans[side]))
    geo = [b.geometry[i] for i in b.layers]
    body = from_rows(*rows, geo, [b.ropes[i] for i in b.layers], h.batch, h.sinks)
    kv = []
    for i, (k, v) in enumerate(body):
        full = []
        for side, x in (("key", k), ("value", v)):
            exact = from_numpy(*arrays[f"exact.{i}.{side}"])
            parts = [exact[:, :, : h.sinks], x.astype(exact.dtype), exact[:, :, h.sinks :]]
            full.append(mx.concatenate(parts, axis=2))
        kv.append(tuple(full))
    caches = build_caches(h.layers, kv, model)
    return (caches, h.user) if return_metadata else caches


def load(
    path: str | os.PathLike,
    *,
    basis: Any = None,
    model: Any = None,
    return_metadata: bool = False,
):
    """Caches from a file written by :func:`velox_kvtc.save` (:func:`decode`'s arguments)."""
    return read_file(
        path, lambda data: decode(data, basis=basis, model=model, return_metadata=return_metadata)
    )


def inspect(path: str | os.PathLike) -> dict[str, Any]:
    """What a KVTC file holds, its header checked (no basis needed): ratio, batch, tokens,
    sinks, window, layers, the basis it needs, and its bytes by part against float16's."""
    data, (arrays, h) = read_file(path, lambda data: (data, read(data)))
    nb = {name: a.nbytes for name, (_, a) in arrays.items()}
    exact = sum(v for k, v in nb.items() if k.startswith("exact."))
    exacts = [a for n, (_, a) in arrays.items() if n.startswith("exact.")]
    per_token = sum(a.shape[1] * a.shape[3] for a in exacts)
    fp16 = 2 * h.batch * h.tokens * per_token
    return {
        "ratio": h.ratio,
        "batch": h.batch,
        "tokens": h.tokens,
        "sinks": h.sinks,
        "window": h.window,
        "layers": [x.get("method", x.get("class")) for x in h.layers],
        "basis_id": h.basis_id,
        "fingerprint": h.fingerprint,
        "bytes": {
            "total": len(data),
            "exact": exact,
            "codes": nb["key.codes"] + nb["value.codes"],
            "scales": nb["key.scales"] + nb["value.scales"],
            "header": len(data) - sum(nb.values()),
            "basis": h.basis_bytes,
            "fp16": fp16,
        },
        "x_fp16": fp16 / len(data),
        "x_fp16_with_basis": fp16 / (len(data) + h.basis_bytes),
        "user": h.user,
    }
