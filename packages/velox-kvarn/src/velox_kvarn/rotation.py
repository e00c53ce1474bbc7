"""The Hadamard rotation KVarN applies to the channels of keys and values.

The authors rotate by the normalized Sylvester Hadamard matrix ``H`` (``H = H^T = H^-1``),
with no random signs. A head dim that is not a power of two has no Sylvester matrix; there
the rotation is block-diagonal, one Sylvester block of the largest power of two dividing the
head dim (16 at head dims 80 and 112, 32 at 96). With a ``seed`` the rotation is velox-core's
randomized Hadamard instead (seeded signs, and a seeded permutation across blocks at those
head dims): an option, not the paper's.
"""

from __future__ import annotations

from velox_core.ops import HadamardRotation

__all__ = ["HadamardRotation"]
