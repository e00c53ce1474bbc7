"""velox-qjl: QJL, 1-bit quantized Johnson-Lindenstrauss keys (arXiv 2406.03482)."""

from velox_core import Method, Uniform

from .cache import QJLCache
from .codec import QJL
from .config import QJLConfig

__all__ = ["METHOD", "QJL", "QJLCache", "QJLConfig"]

METHOD = Method.of(
    QJLCache,
    summary="keys as 1-bit JL sign sketches + norm (unbiased scores), outlier channels apart",
    paper="https://arxiv.org/abs/2406.03482",
    codecs=(QJL, Uniform),
    # per token and KV head at head dim 128 (mlx-lm QuantizedKVCache, group 64: 4-bit 144 B,
    # 3-bit 112 B, 2-bit 80 B), plus the float16 projection once per layer: see docs/qjl.md
    recommended=(
        # the "4-bit": 88.1 B coded + a 384-token fp16 window, a fixed cost: no larger than
        # mlx-lm's 4-bit cache at 4,096 tokens (velox bench, docs/results.md) and from about
        # 4,600 on, larger below about 3,600 (at 2 KV heads; docs/qjl.md)
        {"sketch": 320, "outlier_bits": 8, "group": 128, "value_bits": 2, "window": 384},
        {"key_bits": 2, "value_bits": 3, "outlier_bits": 8, "group": 64, "window": 0},  # 100.1 B
        {"key_bits": 1, "value_bits": 2, "outlier_bits": 8, "group": 64, "window": 0},  # 68.1 B
        {},  # the paper's released setting: m = 256, 8 outliers x 32 bits, 2-bit values, window 128
    ),
)
