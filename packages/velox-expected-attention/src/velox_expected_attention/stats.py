"""The statistics of the queries, and the RoPE averaged over the positions to come.

Expected Attention models the queries a layer will ask next as a Gaussian: the mean and
covariance of its *pre-RoPE* queries so far (per query head), turned to the positions to come
by the RoPE rotation averaged over the next ``n_future_positions`` positions
(:func:`average_rotation`). :class:`QueryStats` holds those moments as running sums, merged
chunk by chunk (Chan et al.'s pairwise update), so a prompt in many chunks gets the moments
of all its queries, as kvpress's one pass over the whole prompt does, in ``O(H_q D^2)``
memory whatever the length.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from velox_core.ops.rope import RopeSpec

__all__ = ["QueryStats", "average_rotation"]

NAME = "expected-attention"


def average_rotation(spec: RopeSpec | None, dim: int, start: int, n: int) -> mx.array:
    """kvpress's averaged RoPE matrix ``R = mean_p R_p`` over positions ``start ... start + n
    - 1``: for each rotated channel pair, ``[[c, -s], [s, c]]`` with ``c`` and ``s`` the means
    of ``cos(p theta)`` and ``sin(p theta)`` (computed in float64); channels a partial RoPE
    leaves alone stay as they are, and ``spec=None`` (a layer without RoPE) gives the identity.
    A pre-RoPE vector ``x`` turns into ``R @ x`` (kvpress: ``mu @ R.T``).

    Shapes:
        returns float32 ``(dim, dim)``.
    """
    if spec is None:
        return mx.eye(dim, dtype=mx.float32)
    first, second, theta = spec.pairs(dim, NAME)
    pos = np.arange(start, start + n, dtype=np.float64)
    ang = pos[:, None] * theta.astype(np.float64)[None, :]
    c, s = np.cos(ang).mean(axis=0), np.sin(ang).mean(axis=0)
    r = np.zeros((dim, dim), dtype=np.float64)
    r[first, first] = c
    r[second, second] = c
    r[first, second] = -s
    r[second, first] = s
    return mx.array(r.astype(np.float32))


class QueryStats:
    """Running mean and covariance of pre-RoPE queries, per batch row and query head.

    Attributes:
        covariance: whether the second moment is kept (``use_covariance``).
        mean: float32 ``(B, H_q, D)``, or None before any query.
        m2: float32 ``(B, H_q, D, D)``, the summed outer products of the deviations from the
            mean (None without ``covariance``).
        count: int32 ``(B,)``, the queries seen per row.
    """

    def __init__(self, covariance: bool = True):
        self.covariance = covariance
        self.mean: mx.array | None = None
        self.m2: mx.array | None = None
        self.count: mx.array | None = None

    @property
    def empty(self) -> bool:
        return self.mean is None

    def arrays(self) -> list[mx.array]:
        return [a for a in (self.mean, self.m2, self.count) if a is not None]

    def clear(self) -> None:
        self.mean = self.m2 = self.count = None

    def add(self, q: mx.array) -> None:
        """Fold in a block of queries (the same ``n`` per row). A block of another batch size
        or head layout starts the statistics over.

        Shapes:
            q ``(B, H_q, n, D)`` (pre-RoPE; any float dtype, summed in float32).
        """
        b, hq, n, d = q.shape
        if n == 0:
            return
        q = q.astype(mx.float32)
        mean_b = mx.mean(q, axis=2)
        m2_b = None
        if self.covariance:
            c = q - mean_b[:, :, None]
            m2_b = mx.swapaxes(c, -1, -2) @ c
        if self.mean is None or self.mean.shape != (b, hq, d):
            self.mean, self.m2 = mean_b, m2_b
            self.count = mx.full((b,), n, dtype=mx.int32)
        else:
            na = self.count.astype(mx.float32).reshape(b, 1, 1)
            total = na + n
            delta = mean_b - self.mean
            self.mean = self.mean + delta * (n / total)
            if self.covariance:
                w = (na * n / total)[..., None]
                self.m2 = self.m2 + m2_b + (delta[..., :, None] * delta[..., None, :]) * w
            self.count = self.count + n
        mx.async_eval(self.arrays())  # detach from the attention call's graph

    def moments(self) -> tuple[mx.array, mx.array | None]:
        """The mean ``(B, H_q, D)`` and the population covariance ``(B, H_q, D, D)`` (the
        deviations' outer products over the count, as kvpress divides; None without
        ``covariance``)."""
        if self.mean is None:
            raise ValueError(f"{NAME}: no query statistics yet")
        if not self.covariance:
            return self.mean, None
        n = mx.maximum(self.count, 1).astype(mx.float32).reshape(-1, 1, 1, 1)
        return self.mean, self.m2 / n

    # -- batch rows ---------------------------------------------------------------------------
    def filter_batch(self, idx: mx.array) -> None:
        if self.mean is not None:
            self.mean, self.count = self.mean[idx], self.count[idx]
            if self.m2 is not None:
                self.m2 = self.m2[idx]

    def extend_batch(self, other: QueryStats) -> None:
        """Append ``other``'s rows; where either side has none (or another head layout) the
        statistics are dropped, and the next cut uses the queries that arrive next."""
        a, b = self, other
        if a.mean is None or b.mean is None or a.mean.shape[1:] != b.mean.shape[1:]:
            self.clear()
            return
        self.mean = mx.concatenate([a.mean, b.mean], axis=0)
        self.count = mx.concatenate([a.count, b.count], axis=0)
        if self.covariance:
            self.m2 = mx.concatenate([a.m2, b.m2], axis=0)

    # -- state --------------------------------------------------------------------------------
    def state(self) -> dict[str, mx.array]:
        if self.mean is None:
            return {}
        out = {"q_mean": self.mean, "q_count": self.count}
        if self.m2 is not None:
            out["q_m2"] = self.m2
        return out

    def set_state(self, state: dict[str, mx.array]) -> None:
        """Restore from :meth:`state` (nothing: no statistics)."""
        mean, m2, count = (state.get(k) for k in ("q_mean", "q_m2", "q_count"))
        if mean is None and m2 is None and count is None:
            self.clear()
            return
        ok = (
            mean is not None
            and count is not None
            and mean.ndim == 3
            and count.shape == (mean.shape[0],)
            and (m2 is not None) == self.covariance
            and (m2 is None or m2.shape == (*mean.shape, mean.shape[-1]))
        )
        if not ok:
            raise ValueError(
                f"{NAME}: the query statistics must be q_mean (B, Hq, D), q_count (B,) and, "
                f"with use_covariance, q_m2 (B, Hq, D, D); got "
                f"{ {k: tuple(v.shape) for k, v in state.items()} }"
            )
        self.mean = mean.astype(mx.float32)
        self.m2 = None if m2 is None else m2.astype(mx.float32)
        self.count = count.astype(mx.int32)
