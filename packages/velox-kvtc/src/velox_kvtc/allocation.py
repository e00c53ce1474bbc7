"""KVTC's bit allocation: which data type each group of PCA components gets, by dynamic
programming under a bit budget per token (arXiv 2511.01815, Sec. 3).

The PCA components of a token (sorted by variance, largest first) are cut into consecutive
groups; a group of ``s`` components (``s`` one of ``sizes``, starting at a multiple of ``s``)
takes one data type of :mod:`velox_kvtc.quant` (``zero`` drops it). A plan's cost is the sum of
its groups' :func:`~velox_kvtc.quant.bits` (codes plus a float16 shift and scale per integer
group and token); its error is the sum of its groups' squared reconstruction errors measured
on calibration rows (:func:`error_table`: the coder's own quantizer on those rows, so it is the
error the coder makes on them; dropped groups cost their energy). :func:`allocate` returns the
plan of least error whose cost is at most the budget: with ``E[i][c]`` the least error of the
first ``i`` components in at most ``c`` bits, ``E[0][c] = 0`` and
``E[i][c] = min over (s, t) with s | i of E[i - s][c - bits(s, t)] + err(i - s, s, t)``, a table
of ``(r + 1) x (budget + 1)`` filled in ``O(r * budget * |sizes| * |types|)``. A plan ends at its
last stored group: the components after it are never stored (nor is their basis).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from .quant import DTYPES, bits, check_dtype, dequantize, quantize

__all__ = ["SIZES", "TYPES", "Group", "Plan", "allocate", "budget_bits", "error_table"]

SIZES = (1, 16, 64, 256, 1024)  # group sizes the allocation may use
TYPES = tuple(t for t in DTYPES if t != "zero")  # stored types (zero is always allowed)


@dataclass(frozen=True)
class Group:
    """``size`` consecutive components stored as ``dtype``."""

    size: int
    dtype: str

    @property
    def bits(self) -> int:
        return bits(self.size, self.dtype)


@dataclass(frozen=True)
class Plan:
    """Groups covering components ``0 .. components - 1``, in order."""

    groups: tuple[Group, ...]

    @property
    def components(self) -> int:
        """Components stored or dropped inside the plan (those after it are never stored)."""
        return sum(g.size for g in self.groups)

    @property
    def bits(self) -> int:
        """Bits per token before entropy coding."""
        return sum(g.bits for g in self.groups)

    def to_json(self) -> list[list]:
        return [[g.size, g.dtype] for g in self.groups]

    @staticmethod
    def from_json(data: object, where: str = "plan") -> Plan:
        """A plan from ``[[size, dtype], ...]``; ``ValueError`` naming ``where`` if malformed."""
        if not isinstance(data, list):
            raise ValueError(f"{where}: a plan is a list of [size, dtype], got {data!r}")
        groups = []
        for g in data:
            if (
                not isinstance(g, list)
                or len(g) != 2
                or isinstance(g[0], bool)
                or not isinstance(g[0], int)
                or g[0] < 1
            ):
                raise ValueError(f"{where}: a group is [size >= 1, dtype], got {g!r}")
            groups.append(Group(g[0], check_dtype(g[1], f"{where}: dtype")))
        return Plan(tuple(groups))


def budget_bits(features: int, ratio: float) -> int:
    """Bits per token of a target compression ``ratio`` against float16 (16 bits a feature),
    before entropy coding: ``floor(16 * features / ratio)``."""
    return int(np.floor(16 * features / ratio))


def _group_errors(z: mx.array, size: int, dtype: str) -> np.ndarray:
    n, r = z.shape
    g = r // size
    x = z[:, : g * size].reshape(n, g, size)
    codes, shift, scale = quantize(x, dtype)
    err = mx.sum(mx.square(x - dequantize(codes, dtype, shift, scale)), axis=(0, 2))
    return np.array(err, dtype=np.float64)


def error_table(
    z: mx.array, sizes: Sequence[int] = SIZES, types: Sequence[str] = TYPES
) -> dict[tuple[int, str], np.ndarray]:
    """Squared error of every aligned group of every size and type on calibration rows.

    Shapes:
        z float32 ``(n, r)``: rows' PCA coefficients; returns ``(size, dtype)`` -> float64
        ``(r // size,)``: group ``j`` covers components ``j*size .. (j+1)*size - 1``
        (``zero``: the group's energy).
    """
    z = z.astype(mx.float32)
    out = {}
    for s in sizes:
        if s > z.shape[1]:
            continue
        for t in ("zero", *types):
            out[(s, t)] = _group_errors(z, s, t)
    return out


def allocate(table: dict[tuple[int, str], np.ndarray], components: int, budget: int) -> Plan:
    """The plan of least error over ``components`` components in at most ``budget`` bits
    per token, from :func:`error_table`'s ``table``.

    Raises:
        ValueError: a budget below 0, or a table that cannot cover the components (it needs
            groups of size 1, or sizes that tile ``components``).
    """
    if budget < 0:
        raise ValueError(f"kvtc: the bit budget must be >= 0, got {budget}")
    options = [(s, t, bits(s, t), e) for (s, t), e in table.items() if bits(s, t) <= budget]
    width = budget + 1
    best = np.full((components + 1, width), np.inf)
    best[0] = 0.0
    choice = np.full((components + 1, width), -1, dtype=np.int32)
    for i in range(1, components + 1):
        row, pick = best[i], choice[i]
        for k, (s, _t, cost, err) in enumerate(options):
            if i % s or i // s > err.size:
                continue
            cand = np.full(width, np.inf)
            cand[cost:] = best[i - s, : width - cost] + err[i // s - 1]
            better = cand < row
            row[better] = cand[better]
            pick[better] = k
    if not np.isfinite(best[components, budget]):
        raise ValueError(f"kvtc: no plan covers {components} components with these groups")
    groups, i, c = [], components, budget
    while i > 0:
        s, t, cost, _ = options[choice[i, c]]
        groups.append(Group(s, t))
        i, c = i - s, c - cost
    groups.reverse()
    while groups and groups[-1].dtype == "zero":
        groups.pop()
    return Plan(tuple(_merge_zeros(groups)))


def _merge_zeros(groups: list[Group]) -> list[Group]:
    out: list[Group] = []
    for g in groups:
        if out and g.dtype == "zero" and out[-1].dtype == "zero":
            out[-1] = Group(out[-1].size + g.size, "zero")
        else:
            out.append(g)
    return out
