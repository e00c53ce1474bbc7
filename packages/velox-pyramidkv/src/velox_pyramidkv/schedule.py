"""PyramidKV's per-layer budgets (arXiv 2406.02069, section 3.2): a pyramid over the layers.

The paper gives the bottom layers many tokens and the top layers few, linearly in between,
with the average held at the stated budget. Write ``A`` for the tokens every layer keeps
whatever the votes (sinks and the observation window: ``sinks + max(window, observe)``),
``X = budget - A`` for the tokens a layer *selects* on average, ``L`` for the number of
layers in the pyramid and ``P = seen - A`` for the candidate tokens (the prompt so far, less
the always-kept ones). The pyramid is the formula of the authors' ``PyramidKVCluster`` and of
kvpress's ``PyramidKVPress.get_layer_budget``, applied to ``X``:

* the top layer selects ``min = X / beta`` and the bottom one ``max = 2 X - min``;
* where ``max > P`` (a prompt too short for the bottom layer's share), ``max = P`` and
  ``min = 2 X - P``: the bottom layers keep every token and the pyramid flattens;
* layer ``l`` (0 = bottom) selects ``round(max - l (max - min) / (L - 1))``.

The values are symmetric about ``X``, so with exact rational arithmetic and Python's
round-half-even the layers select exactly ``L X`` tokens together: the whole model keeps
``L x budget`` tokens per KV head, as a uniform budget would. While ``P <= X`` every layer
keeps every token (nothing is evicted anywhere). One layer (``L = 1``) selects ``X``.

Deviations: the authors' code divides with ``//`` (``min = X // beta``, ``steps = (max - min)
// (L - 1)``), which rounds the steps down and lets the layers together keep up to ``(L - 1)
/ 2`` tokens per layer more than ``L x budget``; it also uses a uniform SnapKV budget for
prompts shorter than ``2 X`` (where the cap above applies here, as in kvpress). kvpress
computes with floats and rounds as here, but counts the observation window *inside* the
pyramid (``n_l = round(max - l steps)`` with ``X`` the average kept count) and falls back to
a uniform budget whenever the top layer's share is below its window (with ``window_size=64``
and ``beta=20``, below an average of 1,280 tokens); here the window is added to every layer,
as the authors do, so the pyramid applies at every budget.
"""

from __future__ import annotations

from fractions import Fraction

__all__ = ["layer_budget", "layer_budgets"]


def layer_budget(
    budget: int, always: int, n_layers: int, beta: float, seen: int, layer: int
) -> int:
    """Tokens layer ``layer`` of the pyramid keeps per KV head (``always`` included).

    Args:
        budget: the average over the layers (tokens per KV head).
        always: tokens every layer keeps whatever the votes (sinks and observation window);
            ``budget > always``.
        n_layers: layers in the pyramid (``L >= 1``).
        beta: the pyramid's steepness (``>= 1``; 1 gives every layer ``budget``).
        seen: tokens the layer has seen (the prompt so far, ``cache.offset``).
        layer: the layer's place, ``0 <= layer < n_layers`` (0: the bottom, which keeps most).

    Returns:
        ``always`` plus the tokens the layer selects: ``max(seen, always)`` while ``seen <=
        budget`` (nothing to evict in any layer), else the pyramid's share.
    """
    x = budget - always
    p = max(seen - always, 0)
    if p <= x:
        return always + p
    if n_layers == 1:
        return budget
    lo = Fraction(x) / Fraction(beta)
    hi = 2 * x - lo
    if hi > p:
        hi, lo = Fraction(p), 2 * x - Fraction(p)
    return always + round(hi - layer * (hi - lo) / (n_layers - 1))


def layer_budgets(budget: int, always: int, n_layers: int, beta: float, seen: int) -> list[int]:
    """:func:`layer_budget` of every layer, bottom first: together ``n_layers * budget`` once
    ``seen > budget``, ``n_layers * max(seen, always)`` before."""
    return [layer_budget(budget, always, n_layers, beta, seen, i) for i in range(n_layers)]
