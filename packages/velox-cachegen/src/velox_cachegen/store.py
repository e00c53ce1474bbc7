"""CacheGen caches at rest and on the wire: :func:`encode` (bytes), :func:`save` (a file),
:func:`encode_levels` (every chunk at every quality level, for a sender that adapts).

A model's caches (mlx-lm ``KVCache`` or velox caches that keep every token: their decoded
tokens, :class:`velox_core.stored.StoredTokens`) are cut into chunks of ``chunk`` token
positions, the last ``window`` positions forming a chunk of their own, coded ``window_step``
times finer (the tokens a next decode step attends to most). Each chunk is quantized
(:mod:`velox_cachegen.quant`: per-channel means, anchors and deltas, a step per layer-side:
:mod:`velox_cachegen.levels`) and range coded under its own frequency tables
(:mod:`velox_cachegen.chunks`); the container (:mod:`velox_cachegen.container`) frames them
behind a header (:mod:`velox_cachegen.header`). Nothing else is needed to decode: no model,
no fitted artifact.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np

from velox_core.artifacts import fingerprint
from velox_core.io import write_atomically
from velox_core.stored import StoredTokens
from velox_core.validation import check_int, check_metadata

from .artifact import resolve_steps
from .chunks import SECTIONS, Settings, encode_chunks, read_meta
from .chunks import spans as chunk_spans
from .container import frame, head
from .header import FORMAT, VERSION
from .levels import LEVELS, LayerSteps
from .quant import DELTAS, spread_of

__all__ = [
    "ANCHOR_STEP",
    "BLOCK",
    "CHUNK",
    "GROUP",
    "STEP",
    "WINDOW",
    "WINDOW_STEP",
    "Ladder",
    "Sizes",
    "encode",
    "encode_levels",
    "save",
]

STEP = 2.75  # the default level: steps of 2.75 times a layer-side's spread, times its multiplier
CHUNK = 2048  # tokens per chunk
WINDOW = 128  # last tokens, coded as a chunk of their own
WINDOW_STEP = 0.125  # the window's step over the others'
GROUP = 10  # tokens per anchor group (the paper's)
ANCHOR_STEP = 0.5  # an anchor's step over its deltas'
BLOCK = 32  # tokens per range-coded stream


@dataclass(frozen=True)
class Sizes:
    """Bytes of a CacheGen cache: ``total`` (the file), of which ``streams`` (the range-coded
    symbols), ``tables`` (the frequency tables), ``side`` (per-chunk means, steps, delta
    flags, stream lengths) and ``header`` (the header, chunk headers and framing); ``fp16``
    is what the same tokens take in float16."""

    total: int
    header: int
    side: int
    tables: int
    streams: int
    fp16: int

    @staticmethod
    def of(data_frames: list[bytes], total: int, fp16: int) -> Sizes:
        side = tables = streams = 0
        for f in data_frames:
            _, sec = read_meta(f)
            tables += len(sec["tables"])
            streams += len(sec["streams"])
            side += sum(len(sec[k]) for k in SECTIONS if k not in ("tables", "streams"))
        return Sizes(total, total - side - tables - streams, side, tables, streams, fp16)


def _float(name: str, v: Any, low: float = 0.0) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise TypeError(f"cachegen: {name} must be a number, got {v!r}")
    if not (low < float(v) < float("inf")):
        raise ValueError(f"cachegen: {name} must be a finite number > {low:g}, got {v!r}")
    return float(v)


@dataclass(frozen=True)
class _Plan:
    tokens: StoredTokens
    header: dict
    spans: list[tuple[int, int, bool]]  # start, stop, is the window
    settings: Settings
    steps: LayerSteps
    x: list[list[np.ndarray]]  # per chunk, per layer-side (B, n, C) float32
    spread: list[list[float]]  # per chunk, per layer-side


def _plan(caches, model, layer_steps, window, chunk, group, anchor_step, delta, metadata, step):
    window = check_int("window", window, minimum=0)
    chunk = check_int("chunk", chunk, minimum=1)
    group = check_int("group", group, minimum=2)
    anchor_step = _float("anchor_step", anchor_step)
    if delta not in DELTAS:
        raise ValueError(f"cachegen: delta must be one of {', '.join(DELTAS)}, got {delta!r}")
    check_metadata(metadata, "cachegen")
    tokens = StoredTokens.read(caches, "cachegen")
    for i, (k, v) in enumerate(tokens.kv):
        if not (mx.all(mx.isfinite(k)).item() and mx.all(mx.isfinite(v)).item()):
            raise ValueError(f"cachegen: layer {i} holds NaN or inf keys or values")
    steps = resolve_steps(layer_steps, model, len(tokens.kv))
    batch, t = tokens.kv[0][0].shape[0], tokens.kv[0][0].shape[2]
    spans = chunk_spans(t, window, chunk)
    geometry = [[k.shape[1], k.shape[3], v.shape[3]] for k, v in tokens.kv]
    channels = tuple(c for h, dk, dv in geometry for c in (h * dk, h * dv))
    settings = Settings(group, anchor_step, delta, BLOCK, batch, channels)
    sides = []
    for k, v in tokens.kv:
        for a in (k, v):
            x = np.array(a.astype(mx.float32))  # (B, H, T, D)
            sides.append(x.transpose(0, 2, 1, 3).reshape(batch, t, -1))
    xs, spread = [], []
    for a, b, _ in spans:
        part = [s[:, a:b] for s in sides]
        xs.append(part)
        spread.append([spread_of(p) for p in part])
    header = {
        "format": FORMAT,
        "version": VERSION,
        "fingerprint": None if model is None else fingerprint(model),
        "batch": batch,
        "tokens": t,
        "geometry": geometry,
        "layers": tokens.layers,
        "chunks": [[a, b] for a, b, _ in spans],
        "group": group,
        "anchor_step": anchor_step,
        "delta": delta,
        "block": BLOCK,
        "quality": {
            "step": step,
            "window": min(window, t),
            "window_step": None,
            "layer_steps": steps.to_json(),
        },
        "user": dict(metadata or {}),
    }
    return _Plan(tokens, header, spans, settings, steps, xs, spread)


def _frames(p: _Plan, level: float, window_step: float) -> list[bytes]:
    mult = p.steps.sides()
    spans, steps = [], []
    for (a, b, is_window), spread in zip(p.spans, p.spread):
        lv = level * (window_step if is_window else 1.0)
        spans.append((a, b, lv))
        steps.append([lv * m * s if s > 0 else lv * m for m, s in zip(mult, spread)])
    return encode_chunks(spans, p.x, steps, p.settings)


def _fp16(p: _Plan) -> int:
    return 2 * sum(k.size + v.size for k, v in p.tokens.kv)


def _encode(caches, model, step, layer_steps, window, window_step, chunk, group, anchor_step,
            delta, metadata) -> tuple[bytes, Sizes]:  # fmt: skip
    step = _float("step", step)
    window_step = _float("window_step", window_step)
    p = _plan(caches, model, layer_steps, window, chunk, group, anchor_step, delta, metadata, step)
    p.header["quality"]["window_step"] = window_step
    frames = _frames(p, step, window_step)
    data = head(p.header) + b"".join(frame(f) for f in frames)
    return data, Sizes.of(frames, len(data), _fp16(p))


def encode(
    caches: list,
    *,
    model: Any = None,
    step: float = STEP,
    layer_steps: Any = None,
    window: int = WINDOW,
    window_step: float = WINDOW_STEP,
    chunk: int = CHUNK,
    group: int = GROUP,
    anchor_step: float = ANCHOR_STEP,
    delta: str = "auto",
    metadata: dict[str, str] | None = None,
) -> bytes:
    """A model's caches as CacheGen bytes (module docstring).

    Args:
        caches: one cache per layer: mlx-lm ``KVCache`` or velox caches that keep every token.
        model: recorded by its fingerprint (checked on load) and used to find its fitted
            layer steps.
        step: the quality level: quantization steps in units of each layer-side's spread
            (larger: smaller and coarser).
        layer_steps: per-layer multipliers of ``step``: a :class:`LayerSteps`, the path of a
            fitted artifact, ``"reference"`` (the reference code's layer groups) or None
            (the model's fitted artifact when ``model`` is given and one is found, else
            ``"reference"``).
        window: the last tokens, coded as a chunk of their own ``window_step`` times finer.
        chunk: tokens per chunk (each decodable alone, with its own tables).
        group: tokens per anchor group.
        anchor_step: an anchor's step over its deltas'.
        delta: ``"auto"`` (per channel, anchor + delta or plain, whichever is smaller),
            ``"anchor"`` (every channel as anchor + delta, the paper) or ``"none"`` (every
            token by itself, the public reference code).
        metadata: strings stored with the cache.

    Raises:
        ValueError, TypeError: caches CacheGen cannot read, NaN or inf tokens, bad arguments.
    """
    args = (step, layer_steps, window, window_step, chunk, group, anchor_step, delta, metadata)
    return _encode(caches, model, *args)[0]


def save(path: str | os.PathLike, caches: list, **kwargs: Any) -> Sizes:
    """Write :func:`encode`'s bytes to ``path`` (atomically) and return their :class:`Sizes`.
    Keyword arguments: :func:`encode`'s."""
    bad = set(kwargs) - set(encode.__kwdefaults__)
    if bad:
        raise TypeError(f"cachegen.save: unexpected arguments {sorted(bad)}")
    opts = {**encode.__kwdefaults__, **kwargs}
    keys = ("step", "layer_steps", "window", "window_step", "chunk", "group", "anchor_step")
    data, sizes = _encode(
        caches, opts["model"], *(opts[k] for k in keys), opts["delta"], opts["metadata"]
    )
    write_atomically(path, lambda tmp: Path(tmp).write_bytes(data))
    return sizes


@dataclass(frozen=True)
class Ladder:
    """Every chunk of one cache coded at every level of ``levels`` (finest first): what a
    CacheGen sender holds to pick each chunk's level as the bandwidth allows.
    ``frames[l][i]`` is chunk ``i`` at level ``levels[l]``; :meth:`assemble` makes the bytes
    of a cache from one level per chunk."""

    levels: tuple[float, ...]
    header: bytes
    frames: list[list[bytes]]

    @property
    def sizes(self) -> np.ndarray:
        """``(levels, chunks)`` bytes of each framed chunk."""
        return np.array([[len(frame(f)) for f in row] for row in self.frames], dtype=np.int64)

    def assemble(self, choice: list[int]) -> bytes:
        """The bytes of a cache whose chunk ``i`` is coded at ``levels[choice[i]]``."""
        n = len(self.frames[0])
        if len(choice) != n or not all(
            isinstance(c, (int, np.integer)) and 0 <= c < len(self.levels) for c in choice
        ):
            raise ValueError(
                f"cachegen: choice must give a level index in 0..{len(self.levels) - 1} for "
                f"each of the {n} chunks, got {choice!r}"
            )
        return self.header + b"".join(frame(self.frames[c][i]) for i, c in enumerate(choice))


def encode_levels(caches: list, *, levels=LEVELS, **kwargs: Any) -> Ladder:
    """Every chunk at every level of ``levels`` (each a ``step``; the window chunk
    ``window_step`` times finer), as a :class:`Ladder`. Other keyword arguments:
    :func:`encode`'s (``step`` excepted)."""
    try:
        levels = tuple(_float("levels", x) for x in levels)
    except TypeError:
        raise TypeError(f"cachegen: levels must be a sequence of numbers, got {levels!r}") from None
    if not levels:
        raise ValueError("cachegen: levels must name at least one level")
    bad = set(kwargs) - (set(encode.__kwdefaults__) - {"step"})
    if bad:
        raise TypeError(f"cachegen.encode_levels: unexpected arguments {sorted(bad)}")
    o = {**encode.__kwdefaults__, **kwargs}
    window_step = _float("window_step", o["window_step"])
    p = _plan(
        caches, o["model"], o["layer_steps"], o["window"], o["chunk"], o["group"],
        o["anchor_step"], o["delta"], o["metadata"], levels[0],
    )  # fmt: skip
    p.header["quality"]["window_step"] = window_step
    frames = [_frames(p, lv, window_step) for lv in levels]
    return Ladder(levels, head(p.header), frames)
