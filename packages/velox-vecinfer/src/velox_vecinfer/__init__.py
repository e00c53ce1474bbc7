"""velox-vecinfer: VecInfer, vector-quantized KV cache with outlier-suppressing smooth and
Hadamard transforms of the keys (arXiv 2510.06175)."""

from velox_core import Method

from .cache import VecInferCache
from .codec import VecInfer
from .config import VecInferConfig

__all__ = ["METHOD", "VecInfer", "VecInferCache", "VecInferConfig"]

METHOD = Method.of(
    VecInferCache,
    summary="smooth + Hadamard keys, then k-means codebooks over sub-vectors of keys and values",
    paper="https://arxiv.org/abs/2510.06175",
    codecs=(VecInfer,),
    # per token and KV head at head dim 128, keys and values (mlx-lm QuantizedKVCache, group
    # 64: 4-bit 144 B, 2-bit 80 B), plus per layer and KV head the codebooks (2 x 4 KiB) and
    # the key scales (512 B); measured on the reference model at 4,096 tokens: docs/vecinfer.md
    recommended=(
        # the "4-bit": 8-bit indices of 2 channels, 128 B, and 32 recent tokens in fp16:
        # 1,586 B/token against mlx-q4's 1,822, lower KL (velox bench, docs/vecinfer.md)
        {"bits": 4, "vector": 2, "window": 32},
        # 2 bits with a 128-token fp16 window: 64 B coded, 978 B/token at 4,096 tokens
        {"bits": 2, "window": 128},
        {"bits": 2},  # the paper's setting: 8-bit indices of 4 channels, 64 B, 835 B/token
    ),
)
