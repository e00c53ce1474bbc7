"""The random rotation ``P`` of RaBitQ: a few rounds of velox-core's randomized Hadamard.

RaBitQ's theory (arXiv 2405.12497, Section 3.1.2) samples ``P`` uniformly from the orthogonal
group; the authors' library (VectorDB-NTU/RaBitQ-Library) replaces it by rounds of random sign
flips and fast Hadamard transforms. One round (``H D x``) leaves structured keys (outlier
channels, a shared direction) visibly biased at 1 bit, since its output law still depends on
where the input's energy sits; two rounds remove that bias in the tests (each round with its
own signs and, for head dims that are not powers of two, its own permutation that mixes the
Hadamard blocks).
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from velox_core.ops import RandomizedHadamard, block_size

__all__ = ["MIN_HADAMARD_BLOCK", "Rotation", "check_dim", "round_seed"]

MIN_HADAMARD_BLOCK = 16  # a block-Hadamard rotation with smaller blocks mixes too little


def round_seed(seed: int, i: int) -> int:
    """An independent 31-bit seed for round ``i`` under ``seed``."""
    return int(np.random.SeedSequence([seed, i]).generate_state(1)[0] >> 1)


def check_dim(dim: int) -> None:
    """Raise ``ValueError`` for head dims the randomized Hadamard rotation does not take well:
    odd ones, and those whose Hadamard block (the largest power of two dividing them) is
    below :data:`MIN_HADAMARD_BLOCK` unless the dim is itself a power of two."""
    blk = block_size(dim)
    if dim < 2 or (blk != dim and blk < MIN_HADAMARD_BLOCK):
        raise ValueError(
            f"rabitq: head dim {dim} is not supported: the randomized Hadamard rotation needs "
            f"a power of two or a multiple of {MIN_HADAMARD_BLOCK} (e.g. 64, 80, 96, 112, 128); "
            f"{dim} has Hadamard blocks of {blk}"
        )


class Rotation:
    """``P x = R_n(... R_1(x))`` with ``R_i`` seeded randomized (block-)Hadamard rotations.

    Args:
        dim: vector length (checked by :func:`check_dim`).
        seed: seed of every round (through :func:`round_seed`).
        rounds: number of rounds, at least 1.

    Shapes:
        ``forward`` and ``inverse`` take ``(..., dim)`` and return float32 ``(..., dim)``.
    """

    def __init__(self, dim: int, seed: int, rounds: int):
        check_dim(dim)
        self.dim = dim
        self.parts = [RandomizedHadamard(dim, round_seed(seed, i)) for i in range(rounds)]

    def forward(self, x: mx.array) -> mx.array:
        for r in self.parts:
            x = r.forward(x)
        return x.astype(mx.float32)

    def inverse(self, y: mx.array) -> mx.array:
        for r in reversed(self.parts):
            y = r.inverse(y)
        return y

    def arrays(self) -> dict[str, mx.array]:
        """The resident arrays: each round's signs (and permutations), float32 / int32."""
        out = {}
        for i, r in enumerate(self.parts):
            out[f"rot{i}.signs"] = r.signs
            if r.perm is not None:
                out[f"rot{i}.perm"] = r.perm
                out[f"rot{i}.inv_perm"] = r.inv_perm
        return out
