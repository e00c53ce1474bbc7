"""The page summaries of RocketKV's second stage (the paper's auxiliary "KT" cache).

The kept (body) tokens of a layer, in the order the cache stores them, are cut into pages of
``page`` consecutive tokens, the last page possibly partial; each page is summarized, per KV
head, by the element-wise minimum and maximum of its keys, stored side by side as one
``2D``-wide row (``[min | max]``) in the cache's storage dtype. :class:`PageSummaries` keeps
them in step with the body: a decode step appends a token, which updates the last page in
place or opens a new one; a cut, a batch change or a trim makes them *stale*, and the next
decode step summarizes the body again from its keys (decoded by the key codec, so coded keys
are summarized as attention reads them).

The summaries are held in a velox-core ``PackedStore`` (the pages as its "tokens"), so a
decode step writes into preallocated rows; they are the policy's state, counted in the
cache's bytes and saved with it.
"""

from __future__ import annotations

import mlx.core as mx

from velox_core.cache.attention import Segment
from velox_core.cache.store import PackedStore
from velox_core.codec.base import Packed

__all__ = ["PageSummaries", "summarize", "summary_weight"]


def summarize(keys: mx.array, page: int, dtype: mx.Dtype) -> mx.array:
    """``[min | max]`` of each page of ``page`` consecutive tokens (the last may be partial).

    Shapes:
        keys ``(B, H, T, D)``; returns ``(B, H, ceil(T / page), 2D)`` in ``dtype``.
    """
    b, h, t, d = keys.shape
    n = -(-t // page)
    pad = n * page - t
    k = keys.astype(mx.float32)
    lo, hi = k, k
    if pad:
        lo = mx.concatenate([k, mx.full((b, h, pad, d), mx.inf, dtype=mx.float32)], axis=2)
        hi = mx.concatenate([k, mx.full((b, h, pad, d), -mx.inf, dtype=mx.float32)], axis=2)
    lo = mx.min(lo.reshape(b, h, n, page, d), axis=3)
    hi = mx.max(hi.reshape(b, h, n, page, d), axis=3)
    return mx.concatenate([lo, hi], axis=-1).astype(dtype)


def summary_weight(key_codec, value_codec, key_dim: int, value_dim: int, dtype) -> float:
    """A page summary's bytes (``2 * key_dim`` values in ``dtype``) over one kept token's (its
    key and value codes, per KV head, measured by coding a zero token): 1 for keys and values
    kept as given in ``dtype`` with equal widths, about 3.2 for 4-bit ``Uniform`` codes in
    groups of 32 at head dim 128."""

    def token(codec, dim: int) -> int:
        return codec.encode(mx.zeros((1, 1, 1, dim), dtype=dtype)).nbytes

    return 2 * key_dim * dtype.size / (token(key_codec, key_dim) + token(value_codec, value_dim))


class PageSummaries:
    """Per-page key minimum and maximum of one layer's body, kept up to date.

    Args:
        page: body tokens per page.

    Attributes:
        covered: body tokens the summaries cover (the first ``covered`` stored tokens).
        stale: whether the body changed otherwise than by appends since they were made.
    """

    def __init__(self, page: int):
        self.page = page
        self.store = PackedStore(4)
        self.covered = 0
        self.stale = True

    def invalidate(self) -> None:
        """The body was cut, trimmed or re-batched: summarize it again before the next use."""
        self.stale = True

    def refresh(self, body: Segment, dtype: mx.Dtype) -> mx.array:
        """The summaries of ``body`` (the cache's kept tokens), updated first: from scratch
        where stale, else only the last partial page and the pages the appends opened.

        Shapes:
            returns ``(B, H, ceil(T / page), 2D)`` for ``T = body.tokens``.
        """
        t, page = body.tokens, self.page
        view = self.store.view()
        batch = body.keys.batch
        if self.stale or self.covered > t or view is None or view.batch != batch:
            start = 0
        else:
            start = self.covered // page * page  # the first token of the last partial page
        if start < t:
            keys = body.key_codec.decode(body.keys.slice(start, t))
            rows = Packed({"kt": summarize(keys, page, dtype)}, -(-(t - start) // page))
            if start == 0:
                self.store.replace(rows)
            else:
                p0 = start // page
                if self.covered % page:  # the last page was partial: rewrite it in place
                    self.store.write(p0, rows.slice(0, 1))
                    rows = rows.slice(1, rows.tokens) if rows.tokens > 1 else None
                if rows is not None:
                    self.store.append(rows)
        self.covered, self.stale = t, False
        return self.store.view().data["kt"]

    # -- state -----------------------------------------------------------------------------
    def state(self) -> dict[str, mx.array]:
        view = self.store.view()
        return {} if view is None or self.stale else {"kt": view.data["kt"]}

    def meta(self) -> dict[str, int]:
        return {"covered": self.covered if not self.stale else 0}

    def set_state(self, kt: mx.array | None, meta: dict | None) -> None:
        """Restore :meth:`state`'s array (None: summarize again at the next use)."""
        covered = int((meta or {}).get("covered", 0))
        if kt is None or covered <= 0:
            self.store.replace(None)
            self.covered, self.stale = 0, True
            return
        if kt.ndim != 4 or kt.shape[2] != -(-covered // self.page):
            raise ValueError(
                f"rocketkv: the page summaries must be (B, H, ceil({covered} / {self.page}), "
                f"2D), got {tuple(kt.shape)}"
            )
        self.store.replace(Packed({"kt": kt}, kt.shape[2]))
        self.covered, self.stale = covered, False

    @property
    def nbytes(self) -> int:
        """Resident bytes of the summaries (the store's spare rows included)."""
        return self.store.nbytes
