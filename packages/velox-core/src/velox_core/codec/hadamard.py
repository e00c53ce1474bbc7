"""Codecs that store their vectors under a Hadamard rotation of their ``seed``.

:class:`HadamardRotated` is the part such codecs share (velox-kvarn's, velox-nsnquant's): the
rotation made for the head dim on first use (:class:`velox_core.ops.HadamardRotation`: the
Sylvester matrix, or seeded signs and a permutation), a seeded rotation's arrays as the
codec's state (saved and counted), a saved state checked against the rotation the seed makes,
and the rotation offered to a prefill that attends in the rotated domain
(:meth:`velox_core.Codec.stored_rotation`).
"""

from __future__ import annotations

import mlx.core as mx

from ..ops.hadamard import HadamardRotation

__all__ = ["HadamardRotated"]


class HadamardRotated:
    """Mixin of a :class:`~velox_core.Codec` with a ``seed`` (None: the Sylvester matrix) that
    codes ``R x``; set ``self.rotation = None`` in ``__init__``."""

    seed: int | None
    rotation: HadamardRotation | None

    def _ready(self, dim: int) -> HadamardRotation:
        """The rotation of ``dim`` channels (made on first use, or anew for another dim)."""
        if self.rotation is None or self.rotation.dim != dim:
            self.rotation = HadamardRotation(dim, self.seed)
        return self.rotation

    def state(self) -> dict[str, mx.array]:
        """A seeded rotation's signs (and permutation); nothing for the Sylvester one."""
        return {} if self.rotation is None else self.rotation.arrays()

    def set_state(self, state: dict[str, mx.array]) -> None:
        """Checks a saved rotation against the one this codec's seed makes (the arrays are
        made from the seed, not loaded); ValueError where they differ or the codec keeps
        none."""
        if not state:
            return
        signs = state.get("rot.signs")
        if self.seed is None or signs is None:
            raise ValueError(f"{self.name}: {self.describe()} keeps no state, got {sorted(state)}")
        mine = self._ready(signs.shape[0]).arrays()
        if set(mine) != set(state) or not all(mx.array_equal(mine[k], state[k]) for k in mine):
            raise ValueError(f"{self.name}: saved rotation does not match {self.describe()}")

    def stored_rotation(self) -> HadamardRotation | None:
        return self.rotation
