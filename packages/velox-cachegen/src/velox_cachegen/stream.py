"""Choosing each chunk's quality level as a cache streams (arXiv 2310.07240, Sec. 5.3).

A CacheGen sender holds every chunk at every level (:func:`velox_cachegen.encode_levels`).
Before it sends a chunk it estimates the throughput from the chunk before (the first chunk
takes a given estimate), and sends it at the finest level at which the chunks still to go
would all arrive before the deadline at that throughput; where none would, at the coarsest.
The paper can also send a chunk as text for the receiver to recompute; velox's streams carry
KV codes only.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

__all__ = ["Schedule", "choose_levels"]


@dataclass(frozen=True)
class Schedule:
    """``choices``: each chunk's level index; ``seconds``: when the last chunk arrived;
    ``met``: whether that is within the deadline."""

    choices: list[int]
    seconds: float
    met: bool


def choose_levels(sizes, deadline: float, bandwidth, first: float | None = None) -> Schedule:
    """Each chunk's level for a transfer at the throughputs ``bandwidth`` (module docstring).

    Args:
        sizes: ``(levels, chunks)`` bytes of each chunk at each level, finest level first
            (:attr:`velox_cachegen.Ladder.sizes`).
        deadline: seconds within which every chunk should have arrived.
        bandwidth: ``(chunks,)`` bytes per second each chunk is sent at (what the sender
            observes only after sending it).
        first: the throughput estimate for the first chunk (default: ``bandwidth[0]``).

    Raises:
        ValueError: shapes that disagree, a non-positive or non-finite throughput or deadline.
    """
    sizes = np.asarray(sizes, dtype=np.float64)
    bw = np.asarray(bandwidth, dtype=np.float64)
    if sizes.ndim != 2 or sizes.size == 0 or np.any(sizes < 0):
        raise ValueError("choose_levels: sizes must be a non-empty (levels, chunks) array >= 0")
    if bw.shape != (sizes.shape[1],) or not np.all(np.isfinite(bw)) or np.any(bw <= 0):
        raise ValueError(
            f"choose_levels: bandwidth must give a throughput > 0 for each of the "
            f"{sizes.shape[1]} chunks"
        )
    if (
        isinstance(deadline, bool)
        or not isinstance(deadline, (int, float))
        or not (0 < deadline < math.inf)
    ):
        raise ValueError(f"choose_levels: deadline must be a positive number, got {deadline!r}")
    estimate = float(bw[0] if first is None else first)
    if not (0 < estimate < math.inf):
        raise ValueError(f"choose_levels: first must be a positive throughput, got {first!r}")
    rest = np.cumsum(sizes[:, ::-1], axis=1)[:, ::-1]  # bytes from chunk i to the end
    t, choices = 0.0, []
    for i in range(sizes.shape[1]):
        fits = np.flatnonzero(t + rest[:, i] / estimate <= deadline)
        level = int(fits[0]) if fits.size else sizes.shape[0] - 1
        choices.append(level)
        t += sizes[level, i] / bw[i]
        estimate = float(bw[i])
    return Schedule(choices, t, t <= deadline)
