"""KVTC caches at rest and on the wire: :func:`encode` / :func:`decode` (bytes), :func:`save` /
:func:`load` (files), :func:`inspect` (what a file holds).

A model's caches (mlx-lm ``KVCache`` or velox caches that keep every token: their decoded
tokens) are read as rows (:mod:`velox_kvtc.features`). The first ``sinks`` and last ``window``
positions are kept exactly, in the dtype the cache stored them in (KVTC leaves attention sinks
and the recent window uncompressed); every other position's key row and value row are
transform coded (:mod:`velox_kvtc.codec`) on the model's fitted basis
(:mod:`velox_kvtc.artifact`) under the plan of the chosen ``ratio``. Loading rebuilds caches of
the saved classes and settings holding the decoded tokens: an mlx-lm ``KVCache`` gets them as
they are, a velox cache is made again and encodes them as a prefill would; decoding continues
from there.

The bytes are a safetensors file (:mod:`velox_kvtc.container`): arrays ``exact.<i>.key`` /
``exact.<i>.value`` (``(B, H, sinks + window, D)``), ``key.codes``, ``key.scales``,
``value.codes``, ``value.scales`` (DEFLATE streams), and metadata ``format``
(``"velox-kvtc-cache"``), ``version``, ``kvtc`` (a JSON header: the model's fingerprint, the
basis's ``basis_id`` and size, the ratio and its plans, batch, tokens, sinks, window, each
layer's class and dtypes, the user's metadata) and ``sha256`` over all of it. The basis is not
in the file (every cache of the model shares it); the header names it and gives its bytes.
A truncated, altered or crafted file, or a basis other than the one a file was coded with, is
refused with a ``ValueError``.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np

from velox_core.artifacts import fingerprint
from velox_core.io import write_atomically
from velox_core.validation import check_int, check_metadata

from . import artifact as art
from .codec import encode_rows
from .container import pack, to_numpy
from .features import read_caches, to_rows
from .fit import ratio_key
from .header import FORMAT, VERSION, digest

__all__ = ["RATIO", "SINKS", "WINDOW", "Sizes", "encode", "save"]

RATIO = 20.0  # the plan a cache is coded with by default (target ratio before DEFLATE)
SINKS = 4  # first tokens kept exactly (the paper's s)
WINDOW = 128  # last tokens kept exactly (the paper's w)
_SIDES = art.SIDES


@dataclass(frozen=True)
class Sizes:
    """Bytes of a KVTC cache: ``total`` (the file), of which ``exact`` (sinks and window),
    ``codes`` and ``scales`` (the DEFLATE streams) and ``header`` (the rest); ``basis`` is the
    size of the fitted arrays the file relies on and does not hold; ``fp16`` what the same
    tokens take in float16."""

    total: int
    header: int
    exact: int
    codes: int
    scales: int
    basis: int
    fp16: int


def _basis(basis: Any, model: Any) -> art.KvtcBasis:
    if isinstance(basis, art.KvtcBasis):
        out = basis
    elif isinstance(basis, (str, os.PathLike)):
        out = art.load_basis_cached(basis)
    elif basis is not None:
        raise TypeError(f"kvtc: basis must be a KvtcBasis or a file path, got {basis!r}")
    elif model is not None:
        out = art.load_basis_cached(art.resolve_basis(model))
    else:
        raise ValueError("kvtc: pass basis= (a KvtcBasis or its file) or model= to find it")
    if model is not None and fingerprint(model) != out.fingerprint:
        raise ValueError(
            f"kvtc: the basis was fitted for another model (fingerprint {out.fingerprint}, "
            f"this model's is {fingerprint(model)}); fit one with `{art.HOW_TO_FIT}`"
        )
    return out


def _check_kv(kv: list, basis: art.KvtcBasis) -> None:
    geo = [basis.geometry[i] for i in basis.layers]
    if len(kv) != len(geo):
        raise ValueError(f"kvtc: {len(kv)} cached layers, the basis was fitted on {len(geo)}")
    for i, ((k, v), (h, dk, dv)) in enumerate(zip(kv, geo)):
        if (k.shape[1], k.shape[3], v.shape[3]) != (h, dk, dv):
            raise ValueError(
                f"kvtc: layer {i} holds (kv_heads, key_dim, value_dim) "
                f"{(k.shape[1], k.shape[3], v.shape[3])}, the basis {(h, dk, dv)}"
            )
    bad = mx.stack([mx.all(mx.isfinite(a)) for kv_i in kv for a in kv_i])
    if not mx.all(bad).item():
        raise ValueError("kvtc: the caches hold NaN or inf keys or values")


def encode(
    caches: list,
    *,
    basis: Any = None,
    model: Any = None,
    ratio: float = RATIO,
    sinks: int = SINKS,
    window: int = WINDOW,
    metadata: dict[str, str] | None = None,
) -> bytes:
    """A model's caches as KVTC bytes (module docstring).

    Args:
        caches: one cache per layer: mlx-lm ``KVCache`` or velox caches that keep every token.
        basis: a :class:`~velox_kvtc.KvtcBasis` or its file; default: the model's, found by
            its fingerprint (``model=`` needed).
        model: checked against the basis, and used to find it.
        ratio: which of the basis's plans codes the tokens (a target ratio against float16
            before DEFLATE: ``floor(16 F / ratio)`` bits per token and side).
        sinks, window: first and last tokens kept exactly.
        metadata: strings stored with the cache (``load(..., return_metadata=True)``).

    Raises:
        ValueError, TypeError: caches KVTC cannot code, a basis of another model or geometry,
            a ratio the basis has no plan for, NaN or inf tokens, bad arguments.
    """
    return _encode(caches, basis, model, ratio, sinks, window, metadata)[0]


def _encode(caches, basis, model, ratio, sinks, window, metadata) -> tuple[bytes, Sizes]:
    sinks, window = check_int("sinks", sinks, minimum=0), check_int("window", window, minimum=0)
    check_metadata(metadata, "kvtc")
    b = _basis(basis, model)
    key = ratio_key(ratio)
    plans = {s: b.plan(key, s) for s in _SIDES}
    kv, layers = read_caches(caches)
    _check_kv(kv, b)
    batch, tokens = kv[0][0].shape[0], kv[0][0].shape[2]
    s = min(sinks, tokens)
    w = min(window, tokens - s)
    ropes = [b.ropes[i] for i in b.layers]
    arrays: dict[str, tuple[str, np.ndarray]] = {}
    for i, (k, v) in enumerate(kv):
        for side, a in (("key", k), ("value", v)):
            exact = mx.concatenate([a[:, :, :s], a[:, :, tokens - w :]], axis=2)
            arrays[f"exact.{i}.{side}"] = to_numpy(exact)
    rows = to_rows(kv, ropes, s, tokens - w)
    for side, x in zip(_SIDES, rows):
        coded = encode_rows(x, b.means[side], b.bases[side], plans[side])
        arrays[f"{side}.codes"] = ("U8", np.frombuffer(coded.codes, np.uint8))
        arrays[f"{side}.scales"] = ("U8", np.frombuffer(coded.scales, np.uint8))
    header = json.dumps(
        {
            "fingerprint": b.fingerprint,
            "basis_id": b.basis_id,
            "basis_bytes": b.nbytes,
            "ratio": key,
            "plans": {side: p.to_json() for side, p in plans.items()},
            "batch": batch,
            "tokens": tokens,
            "sinks": s,
            "window": w,
            "layers": layers,
            "user": metadata or {},
        },
        sort_keys=True,
    )
    meta = {"format": FORMAT, "version": VERSION, "kvtc": header}
    meta["sha256"] = digest(arrays, header)
    data = pack(arrays, meta)
    nb = lambda names: sum(arrays[n][1].nbytes for n in names)  # noqa: E731
    exact = nb([n for n in arrays if n.startswith("exact.")])
    codes, scales = nb([f"{x}.codes" for x in _SIDES]), nb([f"{x}.scales" for x in _SIDES])
    fp16 = 2 * batch * tokens * sum(h * (dk + dv) for h, dk, dv in b.geometry.values())
    rest = len(data) - exact - codes - scales
    sizes = Sizes(len(data), rest, exact, codes, scales, b.nbytes, fp16)
    return data, sizes


def save(
    path: str | os.PathLike,
    caches: list,
    *,
    basis: Any = None,
    model: Any = None,
    ratio: float = RATIO,
    sinks: int = SINKS,
    window: int = WINDOW,
    metadata: dict[str, str] | None = None,
) -> Sizes:
    """Write :func:`encode`'s bytes to ``path`` (atomically: a failed save leaves the old
    file as it was) and return their :class:`Sizes`. Arguments: :func:`encode`'s."""
    data, sizes = _encode(caches, basis, model, ratio, sinks, window, metadata)
    write_atomically(path, lambda tmp: Path(tmp).write_bytes(data))
    return sizes
