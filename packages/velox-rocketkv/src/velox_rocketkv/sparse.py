"""RocketKV's second stage: hybrid sparse attention (arXiv 2502.14051, section 3).

At a decode step, attention is approximated cheaply over every kept token, and computed
exactly only over the ``topk`` tokens the approximation ranks first. The approximation
reduces both dimensions of ``q . k``:

* **sequence** (Quest's pages): the kept keys are summarized per page of ``page`` consecutive
  stored tokens by their element-wise minimum and maximum (:mod:`velox_rocketkv.pages`); for
  a channel where the query is positive the page's maximum bounds ``q_i k_i`` from above, where
  it is negative the minimum does, so ``sum_i q_i * (max_i or min_i)`` bounds the page's
  scores;
* **head dimension** (SparQ's channels): only the ``channels`` channels where ``|q|`` is
  largest enter that sum, and the softmax temperature is raised by
  ``sqrt(sum |q_selected| / sum |q|)`` to make up for the missing ones.

GQA: the query heads sharing a KV head choose one set of channels (their ``|q|`` summed), one
sign per channel (their ``q`` summed) and one set of tokens (their approximate softmax weights
summed), so each KV head gathers its selection once. Each token takes its page's score; the
``topk`` highest are attended, with one softmax over them (and the sinks and window, if any).

:class:`HybridSparse` holds and checks the settings; :func:`select_tokens` is the selection,
on arrays.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import mlx.core as mx

from velox_core.validation import check_float, check_int

from .split import channels_for, page_for, topk_for

__all__ = ["HybridSparse", "check_channels", "select_tokens", "sparse_settings", "step_reads"]


def check_channels(channels) -> int | float:
    """Key channels of the approximate scores: a whole number >= 1, or a fraction of the head
    dim in (0, 1]."""
    if isinstance(channels, bool) or not isinstance(channels, (int, float)):
        raise TypeError(
            f"channels must be a whole number of key channels or a fraction of the head dim "
            f"in (0, 1], got {type(channels).__name__} {channels!r}"
        )
    if isinstance(channels, int):
        return check_int("channels", channels, minimum=1)
    share = check_float("channels", channels, minimum=0.0, open_min=True)
    if share > 1.0:
        raise ValueError(
            f"channels={channels}: a fraction of the head dim must be at most 1; give a whole "
            "number for a count of channels"
        )
    return share


@dataclass(frozen=True)
class HybridSparse:
    """The second stage's settings, checked.

    Attributes:
        ratio: its compression ``c2`` (>= 1): the kept tokens over the tokens' worth of keys
            and values a decode step reads; ``page``, ``channels`` and ``topk`` follow from it
            where not given (:mod:`velox_rocketkv.split`).
        topk: tokens attended exactly per decode step and KV head (None: half of
            ``capacity / ratio``).
        page: kept tokens per page summary (None: ``min(floor(c2), ceil(sqrt(c2)))``).
        channels: key channels of the approximate scores, a count or a fraction of the head
            dim (None: ``round(D page / c2)``).
    """

    ratio: float
    topk: int | None = None
    page: int | None = None
    channels: int | float | None = None

    def __post_init__(self):
        check_float("ratio", self.ratio, minimum=1.0)
        if self.topk is not None:
            check_int("topk", self.topk, minimum=1)
        if self.page is not None:
            check_int("page", self.page, minimum=1)
        if self.channels is not None:
            check_channels(self.channels)

    @property
    def page_size(self) -> int:
        return self.page if self.page is not None else page_for(self.ratio)

    def top_k(self, capacity: int) -> int:
        """Tokens a decode step attends, for ``capacity`` kept body tokens."""
        return self.topk if self.topk is not None else topk_for(capacity, self.ratio)

    def channel_count(self, head_dim: int) -> int:
        """Key channels the approximate scores read, for keys of ``head_dim`` channels."""
        c = self.channels
        if c is None:
            return channels_for(self.ratio, self.page_size, head_dim)
        if isinstance(c, float):
            return max(1, min(head_dim, round(c * head_dim)))
        if c > head_dim:
            raise ValueError(
                f"rocketkv: channels={c} exceeds the key head dim {head_dim}; give at most "
                f"{head_dim}, or a fraction of the head dim"
            )
        return c


def sparse_settings(ratio, topk, page, channels) -> HybridSparse | None:
    """The checked settings, or None where ``ratio`` is None (no second stage: every kept
    token is attended), which then takes none of the others."""
    if ratio is None:
        named = (("topk", topk), ("page", page), ("channels", channels))
        given = [n for n, v in named if v is not None]
        if given:
            raise ValueError(
                f"{', '.join(given)} set the second stage, which ratio=None turns off; give a "
                "ratio (6.0 by default) or leave them None"
            )
        return None
    return HybridSparse(ratio, topk, page, channels)


def select_tokens(
    q: mx.array, kt: mx.array, tokens: int, page: int, channels: int, k: int, scale: float
) -> mx.array:
    """The ``k`` kept tokens of each KV head that the approximate scores rank first.

    Args:
        q: one decode step's queries, the query heads of each KV head together (mlx-lm's
            grouped layout ``h * R + j``), post-RoPE.
        kt: each page's element-wise key minimum then maximum (:mod:`velox_rocketkv.pages`).
        tokens: kept body tokens (pages hold ``page`` of them each, the last possibly fewer).
        page: tokens per page.
        channels: how many key channels the approximation reads.
        k: tokens to select, ``1 <= k <= tokens``.
        scale: the model's attention scale.

    Returns:
        int32 ``(B, H, k)``: indices into the kept tokens (unordered).

    Shapes:
        q ``(B, H, R, D)``, kt ``(B, H, P, 2D)`` with ``P = ceil(tokens / page)``.
    """
    b, h, _, d = q.shape
    q = q.astype(mx.float32)
    aq = mx.abs(q)
    if channels < d:
        i1 = mx.argpartition(-mx.sum(aq, axis=2), kth=channels - 1, axis=-1)[..., :channels]
        qh = mx.take_along_axis(q, i1[:, :, None, :], axis=-1)  # (B, H, R, c)
        frac = mx.sum(mx.abs(qh), axis=-1, keepdims=True) / mx.sum(aq, axis=-1, keepdims=True)
        temp = mx.sqrt(mx.where(frac > 0, frac, 1.0))  # SparQ's correction of the softmax
    else:
        i1 = mx.broadcast_to(mx.arange(d, dtype=mx.int32), (b, h, d))
        qh, temp = q, 1.0
    positive = mx.sum(qh, axis=2) > 0  # the group's sign per channel: max, else min
    col = i1 + mx.where(positive, d, 0)
    kh = mx.take_along_axis(kt, col[:, :, None, :], axis=-1).astype(mx.float32)  # (B,H,P,c)
    logits = (qh @ mx.swapaxes(kh, -1, -2)) * (scale / temp)  # (B, H, R, P)
    n_pages = kt.shape[2]
    last = tokens - (n_pages - 1) * page  # tokens in the last page
    counts = mx.concatenate(
        [mx.full((n_pages - 1,), page, dtype=mx.float32), mx.array([last], dtype=mx.float32)]
    )
    # every token of page j scores logits_j: a softmax over tokens is one over pages weighted
    # by their token counts; each token's weight is exp(logits_j - lse)
    lse = mx.logsumexp(logits + mx.log(counts), axis=-1, keepdims=True)
    weight = mx.sum(mx.exp(logits - lse), axis=2)  # (B, H, P): summed over the group
    per_token = mx.repeat(weight, page, axis=-1)[..., :tokens]
    return mx.argpartition(-per_token, kth=k - 1, axis=-1)[..., :k].astype(mx.int32)


def step_reads(tokens: int, page: int, channels: int, head_dim: int, k: int) -> float:
    """Tokens' worth of keys and values one step reads, per KV head: ``channels`` of each
    page's ``2D`` summary (one of min or max per channel) and ``k`` whole tokens
    (``2D`` each, key and value): ``ceil(T / page) * channels / (2D) + k``."""
    return math.ceil(tokens / page) * channels / (2 * head_dim) + k
