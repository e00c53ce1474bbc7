"""velox-agetiered: KV-cache precision by token age (a velox method; no paper).

Recent tokens are kept at high precision, older ones at fewer bits, the oldest at the fewest:
three tiers of ``velox_core.Uniform`` codes with two age boundaries, built on velox-core's
age tiers. See docs/agetiered.md.
"""

from velox_core import Method, Uniform

from .cache import AgeTieredCache
from .config import AgeTieredConfig

__all__ = ["METHOD", "AgeTieredCache", "AgeTieredConfig"]

METHOD = Method.of(
    AgeTieredCache,
    summary="precision by token age: recent tokens at high bits, older at fewer, oldest fewest",
    codecs=(Uniform,),
    recommended=(
        # 3.97 bits at 4,096 tokens: no more bytes than mlx-lm's 4-bit cache there
        {"recent_bits": 8, "middle_bits": 6, "old_bits": 3, "recent": 64, "middle": 1216},
        # 3.13 bits at 4,096 tokens
        {"recent_bits": 8, "middle_bits": 6, "old_bits": 3, "recent": 64, "middle": 64},
        # 2.16 bits at 4,096 tokens
        {"recent_bits": 8, "middle_bits": 4, "old_bits": 2, "recent": 64, "middle": 128},
    ),
)
