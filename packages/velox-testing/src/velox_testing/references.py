"""NumPy references the eviction methods' tests compare against: SnapKV's window votes
(:func:`window_votes_reference`), torch's 1-d pooling (:func:`pool1d_reference`), and the
state of a transcription of a policy that accumulates attention scores
(:class:`ScoreReference`)."""

from __future__ import annotations

import numpy as np

from .kv import softmax_reference

__all__ = ["ScoreReference", "pool1d_reference", "window_votes_reference"]


class ScoreReference:
    """The state of a NumPy (float64) transcription of a policy that adds each query's
    attention to the scores of the tokens it sees, per KV head (H2O's rule and its kin):
    ``pos[h]``, the positions KV head ``h`` keeps, and ``score[h]``, their scores. A subclass
    transcribes the method's own attend and cut with :meth:`store`, :meth:`weights` and
    :meth:`keep_heavy`.

    Args:
        k: the keys of every token, ``(1, H, T, D)``.
        q: their queries, ``(1, Hq, T, D)`` (``Hq / H`` query heads a KV head).
    """

    def __init__(self, k, q):
        self.k, self.q = np.array(k[0], np.float64), np.array(q[0], np.float64)
        self.h = self.k.shape[0]
        self.r = self.q.shape[0] // self.h
        self.pos = [np.zeros(0, dtype=int) for _ in range(self.h)]
        self.score = [np.zeros(0) for _ in range(self.h)]

    def store(self, s: int, e: int) -> None:
        """Tokens ``s`` to ``e - 1`` join every KV head, scored 0."""
        for h in range(self.h):
            self.pos[h] = np.concatenate([self.pos[h], np.arange(s, e)])
            self.score[h] = np.concatenate([self.score[h], np.zeros(e - s)])

    def logits(self, h: int, i: int, seen: np.ndarray, scale: float) -> np.ndarray:
        """The logits of query ``i``'s heads of KV head ``h`` over the head's tokens ``seen``
        (a mask over ``pos[h]``), times ``scale``: ``(Hq / H, n)``."""
        qs = self.q[h * self.r : (h + 1) * self.r, i]
        return qs @ self.k[h, self.pos[h][seen]].T * scale

    def weights(self, h: int, i: int, scale: float) -> tuple[np.ndarray, np.ndarray]:
        """Query ``i``'s softmax weights over the tokens KV head ``h`` holds at or before
        ``i`` (causal), the mean over the head's query heads (GQA). Returns ``(seen, w)``:
        the mask over ``pos[h]`` and the weights ``(n,)``."""
        seen = self.pos[h] <= i
        return seen, softmax_reference(self.logits(h, i, seen, scale)).mean(0)

    def keep_heavy(self, budget: int, recent: int, offset: int) -> None:
        """In each KV head over ``budget``: keep the tokens at ``offset - recent`` and after,
        and the top ``budget - recent`` of the others by score (the earlier first among
        equal scores)."""
        for h in range(self.h):
            p, s = self.pos[h], self.score[h]
            if len(p) <= budget:
                continue
            old = np.flatnonzero(p < offset - recent)
            heavy = old[np.argsort(-s[old], kind="stable")[: budget - recent]]
            keep = np.union1d(heavy, np.flatnonzero(p >= offset - recent))
            self.pos[h], self.score[h] = p[keep], s[keep]

    def kept(self, h: int = 0) -> set[int]:
        """The positions KV head ``h`` keeps."""
        return set(self.pos[h].tolist())


def window_votes_reference(k, q, t: int, window: int, scale: float) -> np.ndarray:
    """SnapKV's votes in NumPy: the softmax of the last ``window`` queries over the first
    ``t`` tokens (causal), summed over the window and averaged over each KV head's query
    heads: ``(H, t)``.

    Shapes:
        k ``(1, H, T >= t, D)``, q ``(1, Hq, t, D)``.
    """
    h, r = k.shape[1], q.shape[1] // k.shape[1]
    kk, qq = np.repeat(np.array(k[0, :, :t]), r, axis=0), np.array(q[0])
    s = np.einsum("hwd,htd->hwt", qq[:, -window:], kk) * scale
    s[:, np.arange(t)[None, :] > np.arange(t - window, t)[:, None]] = -np.inf
    return softmax_reference(s).sum(1).reshape(h, r, -1).mean(1)


def pool1d_reference(x: np.ndarray, kernel: int, pooling: str) -> np.ndarray:
    """torch's ``avg_pool1d`` / ``max_pool1d`` of ``x`` ``(n,)`` with stride 1 and padding
    ``kernel // 2`` (``pooling`` ``"avg"`` or ``"max"``), in NumPy: ``(n,)``."""
    if pooling not in ("avg", "max"):
        raise ValueError(f"pooling={pooling!r} must be 'avg' or 'max'")
    pad = kernel // 2
    xp = np.pad(x, (pad, pad))
    win = np.stack([xp[i : i + len(x)] for i in range(kernel)])
    return win.max(0) if pooling == "max" else win.sum(0) / kernel
