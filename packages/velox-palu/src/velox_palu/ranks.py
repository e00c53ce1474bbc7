"""Rank allocation: how many latent dimensions each layer's keys and values keep.

Palu (arXiv 2407.21118, Sec. 3.3) allocates a parameter budget over the key and value
projections of every layer in proportion to their Fisher information (the authors'
``rank_search.py``, ``fisher_uniform``: one Fisher value per projection, the mean over its
weights of the root-mean-square gradient of the language-model loss; each projection's
rank split equally over its head groups). ``ratio`` is their ``param_ratio_target``: the kept
latent dimensions as a fraction of all key and value channels (0.5 halves the fp16 cache).

Here ranks come in steps of ``step`` per group (the head group size ``g`` at least, so that
the group's latent splits evenly over its heads' rows of the cache), every projection keeps
one step at least and at most all ``gD`` dimensions, and the sum is exactly
``round(ratio * total / step)`` steps: a projection's share is floored, then the remaining
steps go to the largest remainders (the authors floor, top up one rank at a time and round
to multiples of 32 afterwards, which moves the total). ``uniform`` gives every projection
the same share (the authors' ``uniform`` search).
"""

from __future__ import annotations

import math

__all__ = ["ALLOCATIONS", "allocate"]

ALLOCATIONS = ("fisher", "uniform")


def allocate(
    fisher: dict[tuple[int, str], float],
    full: int,
    ratio: float,
    step: int,
) -> dict[tuple[int, str], int]:
    """Per-group ranks of every projection.

    Args:
        fisher: ``(layer, side)`` -> weight (Fisher information, or 1.0 each for uniform).
        full: dimensions of a group (``gD``), the largest rank.
        ratio: kept fraction of all dimensions, in ``(0, 1]``.
        step: rank granularity (divides ``full``).

    Returns:
        ``(layer, side)`` -> rank, each a multiple of ``step`` in ``[step, full]``, summing to
        ``step * round(ratio * len(fisher) * full / step)`` (at least one step each).
    """
    if not fisher:
        raise ValueError("allocate: no projections")
    if not 0.0 < ratio <= 1.0:
        raise ValueError(f"ratio must be in (0, 1], got {ratio}")
    if step < 1 or full % step:
        raise ValueError(f"palu: rank step {step} must divide the group's {full} dimensions")
    units = full // step
    keys = sorted(fisher)
    target = min(max(round(ratio * len(keys) * units), len(keys)), len(keys) * units)
    w = {k: max(float(fisher[k]), 0.0) for k in keys}
    total = sum(w.values())
    if not math.isfinite(total) or total <= 0.0:
        raise ValueError(f"palu: Fisher information must be positive and finite, got {fisher}")
    want = {k: target * w[k] / total for k in keys}
    got = {k: min(units, max(1, math.floor(want[k]))) for k in keys}
    # the remaining steps: largest remainder first (ties in layer order), within the caps
    while sum(got.values()) < target:
        k = max((k for k in keys if got[k] < units), key=lambda k: want[k] - got[k])
        got[k] += 1
    while sum(got.values()) > target:
        k = min((k for k in keys if got[k] > 1), key=lambda k: want[k] - got[k])
        got[k] -= 1
    return {k: got[k] * step for k in keys}
