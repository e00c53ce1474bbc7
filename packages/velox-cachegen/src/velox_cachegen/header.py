"""The header of a CacheGen cache, and every field checked before it is used.

Fields: ``format`` (``"velox-cachegen-cache"``), ``version``, ``fingerprint`` (the model's,
or null when saved without one), ``batch``, ``tokens``, ``geometry`` (each layer's
``[kv_heads, key_dim, value_dim]``), ``layers`` (each layer's record:
:class:`velox_core.stored.StoredTokens`), ``chunks`` (each chunk's ``[start, stop)``, back to
back from 0 to ``tokens``), ``group``, ``anchor_step``, ``delta``, ``block`` (the coding
settings every chunk shares: :class:`velox_cachegen.chunks.Settings`), ``quality`` (what the
sender asked for: ``step`` (a ladder's finest level; each chunk carries its own), ``window``,
``window_step`` and ``layer_steps``) and ``user`` (the caller's metadata). :func:`check`
refuses anything else with a ``ValueError`` naming the field.
"""

from __future__ import annotations

import math
from typing import Any

from velox_core.stored import StoredTokens, header_int, header_user

from .chunks import Settings
from .levels import LayerSteps
from .quant import DELTAS

__all__ = ["FORMAT", "VERSION", "check", "settings"]

FORMAT = "velox-cachegen-cache"
VERSION = 1
FIELDS = {
    "format",
    "version",
    "fingerprint",
    "batch",
    "tokens",
    "geometry",
    "layers",
    "chunks",
    "group",
    "anchor_step",
    "delta",
    "block",
    "quality",
    "user",
}


def _pos(h: dict, name: str) -> float:
    v = h[name]
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not (0 < v < math.inf):
        raise ValueError(f"corrupt header: {name} must be a positive number, got {v!r}")
    return float(v)


def chunk_count(header: Any) -> int:
    """How many chunks a header lists (checked enough to count them)."""
    if not isinstance(header, dict) or header.get("format") != FORMAT:
        got = header.get("format") if isinstance(header, dict) else header
        raise ValueError(f"not a velox-cachegen cache (format {got!r})")
    if header.get("version") != VERSION:
        raise ValueError(
            f"unsupported velox-cachegen cache version {header.get('version')!r} (this "
            f"velox-cachegen reads {VERSION})"
        )
    chunks = header.get("chunks")
    if not isinstance(chunks, list) or not chunks:
        raise ValueError("corrupt header: chunks must be a non-empty list")
    return len(chunks)


def check(h: Any) -> dict:
    """The header, every field checked (module docstring).

    Raises:
        ValueError: another format or version, a missing, extra or malformed field.
    """
    chunk_count(h)
    if set(h) != FIELDS:
        raise ValueError(f"corrupt header: fields {sorted(h)}, expected {sorted(FIELDS)}")
    fp = h["fingerprint"]
    if fp is not None and (not isinstance(fp, str) or not fp):
        raise ValueError(f"corrupt header: fingerprint must be a string or null, got {fp!r}")
    batch, tokens = header_int(h, "batch", 1), header_int(h, "tokens", 1)
    header_int(h, "group", 2), header_int(h, "block", 1), _pos(h, "anchor_step")
    if h["delta"] not in DELTAS:
        raise ValueError(f"corrupt header: delta {h['delta']!r} (allowed: {', '.join(DELTAS)})")
    layers = StoredTokens.check_records(h["layers"], "corrupt header")
    geo = h["geometry"]
    if (
        not isinstance(geo, list)
        or len(geo) != len(layers)
        or not all(
            isinstance(g, list)
            and len(g) == 3
            and all(isinstance(x, int) and not isinstance(x, bool) and x >= 1 for x in g)
            for g in geo
        )
    ):
        raise ValueError(
            f"corrupt header: geometry must list [kv_heads, key_dim, value_dim] for each of "
            f"the {len(layers)} layers"
        )
    at = 0
    for i, c in enumerate(h["chunks"]):
        if (
            not isinstance(c, list)
            or len(c) != 2
            or not all(isinstance(x, int) and not isinstance(x, bool) for x in c)
            or c[0] != at
            or c[1] <= c[0]
        ):
            raise ValueError(
                f"corrupt header: chunk {i} is {c!r}; chunks must be [start, stop] spans back "
                f"to back from 0"
            )
        at = c[1]
    if at != tokens:
        raise ValueError(f"corrupt header: the chunks cover {at} tokens, the header {tokens}")
    q = h["quality"]
    if not isinstance(q, dict) or set(q) != {"step", "window", "window_step", "layer_steps"}:
        raise ValueError("corrupt header: quality must hold step, window, window_step, layer_steps")
    _pos(q, "step"), header_int(q, "window", 0), _pos(q, "window_step")
    ls = q["layer_steps"]
    if not isinstance(ls, dict) or set(ls) != {"key", "value"}:
        raise ValueError("corrupt header: layer_steps must hold key and value")
    try:
        steps = LayerSteps(ls["key"], ls["value"])
    except (TypeError, ValueError) as e:
        raise ValueError(f"corrupt header: {e}") from None
    if len(steps.key) != len(layers):
        raise ValueError(
            f"corrupt header: layer_steps for {len(steps.key)} of {len(layers)} layers"
        )
    header_user(h)
    del batch
    return h


def settings(h: dict) -> Settings:
    """The chunks' shared settings, from a checked header."""
    channels = tuple(c for hh, dk, dv in h["geometry"] for c in (hh * dk, hh * dv))
    return Settings(
        h["group"], float(h["anchor_step"]), h["delta"], h["block"], h["batch"], channels
    )
