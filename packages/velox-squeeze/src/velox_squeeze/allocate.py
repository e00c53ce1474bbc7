"""SqueezeAttention's layer budgets (arXiv 2404.04793, section 4 and Algorithm 1).

A layer's **importance** is measured during the prefill: the cosine similarity between the
hidden state entering its attention block and the one leaving it (``x`` and ``x + attn(x)``,
the residual stream around the attention), averaged over the prompt's tokens. A cosine near 1
means the attention barely changed the tokens, so its cache matters least.

The layers' cosines are clustered into three groups by 1-D k-means (:func:`kmeans_1d`), and
the group with the highest cosine is **squeezed**. Write ``A`` for the tokens every layer keeps
whatever the policy chooses (sinks, and SnapKV's observation window or the window:
``sinks + max(window, observe)``), ``X = budget - A`` for the tokens a layer *selects* on
average, ``L`` for the layers, ``S`` of them squeezed, and ``P = seen - A`` for the candidate
tokens (the prompt so far less the always-kept ones):

* each squeezed layer selects ``round(p X)`` (``p``: the squeeze factor);
* the ``L - S`` others share the rest, ``L X - S round(p X)``, equally (the first layers in
  model order take one more token where it does not divide);
* where that share exceeds ``P`` (a prompt not much longer than the budget), those layers
  keep every candidate and the squeezed layers share what is left, so that the layers
  together always select ``L X`` tokens: the whole model keeps ``L x budget`` tokens per KV
  head, as a uniform budget would (:func:`layer_budgets` sums to it exactly);
* while ``P <= X`` every layer keeps every token (nothing is evicted anywhere).

Fewer than three distinct cosines (one or two layers, or layers that tie) form no three
groups: every layer then keeps ``budget`` (a uniform budget).

Deviations from the authors' code (``utils_hh/modify_llama_drop.py``): it clusters with
scikit-learn's ``KMeans(n_clusters=3)`` (Lloyd's iterations from a random start); here the
clustering is the exact optimum of the 1-D problem (dynamic programming over the sorted
cosines: the same groups wherever Lloyd's finds the optimum, and the same on every run). Its
budgets are fractions of the prompt length (``--ini_size``, and ``--KV_class3`` for the
squeezed group, the ratio of the two being ``p``), its windows rounded down; here ``budget`` is
a count of tokens (the CLI's ``budget=25%`` takes a share of the prompt), ``p`` scales the
selected tokens beyond the always-kept ones, and the rounding keeps the total exact.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["GROUPS", "Place", "kmeans_1d", "layer_budget", "layer_budgets", "places"]

GROUPS = 3  # the paper's clusters: the one of highest cosine is squeezed


def kmeans_1d(values: list[float], k: int = GROUPS) -> list[int] | None:
    """The exact k-means clustering of scalar ``values`` into ``k`` groups.

    In one dimension an optimal clustering is a partition of the sorted values into runs;
    this finds the runs of least total squared distance to their means by dynamic
    programming (equal values stay in one group; ties between partitions go to the one whose
    groups end earliest).

    Returns:
        Each value's group, ``0`` (lowest mean) to ``k - 1`` (highest), or None where fewer
        than ``k`` distinct values exist.
    """
    distinct = sorted(set(values))
    n = len(distinct)
    if n < k:
        return None
    weight = [sum(1 for v in values if v == d) for d in distinct]
    mid = sum(values) / len(values)  # centred sums: no cancellation between close values
    s0, s1, s2 = [0.0], [0.0], [0.0]
    for d, w in zip(distinct, weight):
        s0.append(s0[-1] + w)
        s1.append(s1[-1] + w * (d - mid))
        s2.append(s2[-1] + w * (d - mid) ** 2)

    def cost(i: int, j: int) -> float:  # distinct values i..j, inclusive
        w, a, b = s0[j + 1] - s0[i], s1[j + 1] - s1[i], s2[j + 1] - s2[i]
        return b - a * a / w

    best = [[cost(0, j) for j in range(n)]]
    start: list[list[int]] = [[0] * n]
    for g in range(1, k):
        row, arg = [float("inf")] * n, [0] * n
        for j in range(g, n):
            for i in range(g, j + 1):
                c = best[g - 1][i - 1] + cost(i, j)
                if c < row[j]:
                    row[j], arg[j] = c, i
        best.append(row)
        start.append(arg)
    group_of = [0] * n
    j = n - 1
    for g in range(k - 1, -1, -1):
        i = start[g][j] if g else 0
        for t in range(i, j + 1):
            group_of[t] = g
        j = i - 1
    index = {d: i for i, d in enumerate(distinct)}
    return [group_of[index[v]] for v in values]


@dataclass(frozen=True)
class Place:
    """A layer's place in the allocation: whether it is squeezed, its rank among the layers of
    its kind (model order, from 0) and how many layers of each kind there are."""

    squeezed: bool
    rank: int
    n_important: int
    n_squeezed: int

    def key(self) -> list:
        """JSON form (saved with the cache)."""
        return [self.squeezed, self.rank, self.n_important, self.n_squeezed]

    @classmethod
    def from_key(cls, key) -> Place:
        squeezed, rank, n_imp, n_sq = key
        if not (isinstance(squeezed, bool) and 0 <= rank < (n_sq if squeezed else n_imp)):
            raise ValueError(f"squeeze: not a layer's place: {key!r}")
        return cls(squeezed, int(rank), int(n_imp), int(n_sq))


def places(importance: list[float]) -> list[Place] | None:
    """Each layer's :class:`Place` from the layers' importance (mean cosines, model order):
    the group of highest cosine is squeezed. None where no three groups form (uniform)."""
    groups = kmeans_1d(importance)
    if groups is None:
        return None
    squeezed = [g == GROUPS - 1 for g in groups]
    n_sq = sum(squeezed)
    out, seen = [], {True: 0, False: 0}
    for s in squeezed:
        out.append(Place(s, seen[s], len(squeezed) - n_sq, n_sq))
        seen[s] += 1
    return out


def _share(total: int, n: int, rank: int) -> int:
    q, r = divmod(total, n)
    return q + (1 if rank < r else 0)


def layer_budget(budget: int, always: int, p: float, seen: int, place: Place | None) -> int:
    """Tokens a layer keeps per KV head once ``seen`` tokens have arrived.

    Args:
        budget: the average over the layers (tokens per KV head), ``> always``.
        always: tokens every layer keeps whatever the policy chooses.
        p: the squeeze factor, in ``[0, 1]``.
        seen: tokens the layer has seen (``cache.offset``: the same in every layer).
        place: the layer's place (None: not decided, or no three groups: ``budget``).
    """
    x = budget - always
    cand = max(seen - always, 0)
    if cand <= x:
        return always + cand
    if place is None or place.n_squeezed == 0 or place.n_important == 0:
        return budget
    total = (place.n_important + place.n_squeezed) * x
    s = round(p * x)
    rest = total - place.n_squeezed * s
    if rest > place.n_important * cand:  # the important layers hold every candidate
        if not place.squeezed:
            return always + cand
        return always + _share(total - place.n_important * cand, place.n_squeezed, place.rank)
    if place.squeezed:
        return always + s
    return always + _share(rest, place.n_important, place.rank)


def layer_budgets(
    budget: int, always: int, p: float, seen: int, importance: list[float]
) -> list[int]:
    """:func:`layer_budget` of every layer (model order) for the layers' ``importance``:
    together ``len(importance) * budget`` once ``seen > budget``."""
    where = places(importance)
    return [
        layer_budget(budget, always, p, seen, None if where is None else where[i])
        for i in range(len(importance))
    ]
