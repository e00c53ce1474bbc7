"""What NestedKV reads back from a :class:`velox_core.VeloxCache`: each KV head's stored keys.

A cache stores, in temporal order, fp16 sinks, the body (coded when ``bits`` is set; the only
part a policy may evict) and an fp16 window. The policy keeps per-token statistics for the
body and window tokens (sinks are never scored), so it reads them as one sequence per head.
"""

from __future__ import annotations

from typing import NamedTuple

import mlx.core as mx

__all__ = ["Stored", "read", "segment"]


class Stored(NamedTuple):
    """The stored keys of a cache.

    Attributes:
        sink: the sink keys ``(B, H, s, D)`` as stored, or None.
        seqs: per KV head, the body then window keys ``(B, S_h, D)`` float32 (decoded), or None.
        pos: per KV head, their absolute positions ``(B, S_h)`` int32, or None.
        body: body tokens per KV head (the first ``body[h]`` entries of ``seqs[h]``).
        window: window tokens (the same for every head).
    """

    sink: mx.array | None
    seqs: list[mx.array | None]
    pos: list[mx.array | None]
    body: list[int]
    window: int


def segment(view, which: str) -> mx.array | None:
    """Keys of the cache's ``"sink"`` or ``"win"`` segment ``(B, H, n, D)``, or None.

    From the view's ``protected()`` (the body comes from ``body_keys`` and
    ``body_positions``).
    """
    sink, win = (part.keys for part in view.protected())
    return sink if which == "sink" else win


def read(view) -> Stored:
    """Every stored key of ``cache`` (lazy: nothing is decoded unless used)."""
    sink, win = segment(view, "sink"), segment(view, "win")
    w = 0 if win is None else win.shape[2]
    win_pos = mx.arange(view.offset - w, view.offset, dtype=mx.int32)
    seqs, poss = [], []
    for h, (k, p) in enumerate(zip(view.body_keys(), view.body_positions())):
        keys = [] if k is None else [k[:, 0].astype(mx.float32)]
        pos = [] if p is None else [p]
        if win is not None:
            keys.append(win[:, h].astype(mx.float32))
            pos.append(mx.broadcast_to(win_pos, (win.shape[0], w)))
        seqs.append(mx.concatenate(keys, axis=1) if keys else None)
        poss.append(mx.concatenate(pos, axis=1) if pos else None)
    return Stored(sink, seqs, poss, view.body_sizes(), w)
