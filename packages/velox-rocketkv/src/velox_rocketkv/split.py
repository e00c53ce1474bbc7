"""How RocketKV splits its compression between the two stages (arXiv 2502.14051).

The paper sets one *token budget* ``B``: the tokens' worth of keys and values a decode step
reads. With ``S`` tokens seen, the total compression is ``c = S / B``; the first stage keeps
``S / c**a`` tokens (``a = min(0.2 + 0.06 log2 c, 0.8)``: the larger the compression, the
larger the share of it done by eviction), so the second stage compresses the rest,
``c2 = c**(1 - a)`` (the paper's example: ``c = 64`` splits into 10.3x and 6.2x). Inside the
second stage ``c2`` splits again, between the sequence (pages of ``page`` tokens summarized by
their element-wise key minimum and maximum) and the head dimension (``channels`` of the
``D`` key channels): ``page = min(floor(c2), ceil(sqrt(c2)))``, ``channels = D page / c2``;
half of ``B`` goes to the approximate scores and half to the exact attention over the
``topk = B / 2`` tokens they select (the authors' ``get_params_for_token_budget`` and
``compress``).

velox states the first stage's result instead of ``B``: ``budget`` is what a layer keeps per
KV head (tokens and page summaries together, so its bytes stay within the budget; see
:func:`body_capacity`), and ``ratio`` is the second stage's ``c2``, from which ``page``,
``channels`` and ``topk`` follow by the rules above (:func:`page_for`, :func:`channels_for`,
:func:`topk_for`). :func:`paper_split` gives ``c2`` for a total compression, for choosing
``ratio``: 5.1 at a 4x eviction, 6.0 at 8x, 6.4 at 16x, 6.1 at 32x (:func:`stage2_for`).
"""

from __future__ import annotations

import math

__all__ = [
    "body_capacity",
    "channels_for",
    "page_for",
    "paper_split",
    "stage2_for",
    "topk_for",
]


def _alpha(total: float) -> float:
    return min(0.2 + math.log2(total) * 0.06, 0.8)


def paper_split(total: float) -> tuple[float, float]:
    """``(stage 1, stage 2)`` compressions of a total compression ``total >= 1``: ``total**a``
    and ``total**(1 - a)``, ``a = min(0.2 + 0.06 log2 total, 0.8)`` (their product is
    ``total``)."""
    total = max(float(total), 1.0)
    a = _alpha(total)
    return total**a, total ** (1.0 - a)


def stage2_for(stage1: float) -> float:
    """The second stage's compression ``c2`` that the paper pairs with a first-stage
    compression ``stage1 >= 1`` (the total ``c`` solving ``c**a = stage1``, by bisection)."""
    stage1 = max(float(stage1), 1.0)
    lo, hi = 1.0, 2.0
    while paper_split(hi)[0] < stage1:
        hi *= 2.0
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        if paper_split(mid)[0] < stage1:
            lo = mid
        else:
            hi = mid
    return paper_split(hi)[1]


def page_for(ratio: float) -> int:
    """Tokens per page for a second-stage compression ``ratio``: ``min(floor(c2),
    ceil(sqrt(c2)))``, at least 1 (the authors' ``chunk_size``)."""
    return max(1, min(math.floor(ratio), math.ceil(math.sqrt(ratio))))


def channels_for(ratio: float, page: int, head_dim: int) -> int:
    """Key channels the approximate scores read: ``round(D page / c2)`` within ``[1, D]``
    (the authors' ``r``: pages shrink the sequence ``page`` times, channels the rest)."""
    return min(head_dim, max(1, round(head_dim * page / ratio)))


def topk_for(capacity: int, ratio: float) -> int:
    """Tokens a decode step attends exactly: half of the token budget ``capacity / c2``
    (the authors' ``topk = token_budget // 2``), at least 1."""
    return max(1, int(capacity / ratio) // 2)


def body_capacity(room: int, page: int | None, weight: float = 1.0) -> int:
    """Body tokens that fit in ``room`` tokens' worth together with their page summaries,
    each summary (a minimum and a maximum key) counted as ``weight`` tokens (its bytes over a
    kept token's: 1 for fp16 keys and values of equal width): the largest ``n`` with
    ``n + weight * ceil(n / page) <= room`` (for ``weight`` 1, ``room - ceil(room / (page +
    1))``); all of ``room`` without summaries (``page`` None)."""
    if room <= 0:
        return 0
    if page is None:
        return room

    def fits(n: int) -> bool:
        return n + weight * -(-n // page) <= room + 1e-9

    n = min(room, int(room * page / (page + weight)))
    while n > 0 and not fits(n):
        n -= 1
    while n < room and fits(n + 1):
        n += 1
    return n
