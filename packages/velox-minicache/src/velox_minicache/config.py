"""Settings of the MiniCache cache."""

from __future__ import annotations

from dataclasses import dataclass

from velox_core.validation import check_float, check_optional

__all__ = ["MiniCacheConfig"]


@dataclass
class MiniCacheConfig:
    """MiniCache (arXiv 2405.14366) settings.

    Attributes:
        t: the SLERP interpolation parameter: the merged direction of a token is
            ``slerp(u_{l-1}, u_l; t)`` of its two unit vectors (0 gives layer ``l-1``'s
            direction, 1 layer ``l``'s, 0.5 the midpoint on the sphere).
        gamma: the retention threshold, in ``[0, 1]``: a token pair is kept unmerged (both
            layers' vectors stored as given) when its angular distance lies within ``gamma``
            of the largest distance seen, ``d > d_max - gamma * (d_max - d_min)``. 0 merges
            every token, 1 keeps all but the closest.
        start_layer: the first merged layer; layers ``start_layer, start_layer + 1`` form the
            first pair, then ``start_layer + 2, start_layer + 3``, ... (a last layer without a
            partner, and every layer before ``start_layer``, stays fp16). None: half the
            model's layers (the paper's ``S = L / 2``).
    """

    t: float = 0.5
    gamma: float = 0.05
    start_layer: int | None = None

    def __post_init__(self):
        check_float("t", self.t, minimum=0.0, maximum=1.0)
        check_float("gamma", self.gamma, minimum=0.0, maximum=1.0)
        check_optional(self, "start_layer", minimum=0)
