"""velox-xkv: xKV, a low-rank token latent shared by a group of adjacent layers, from a
cross-layer SVD of their pre-RoPE keys and of their values (arXiv 2503.18893)."""

from velox_core import Method
from velox_core.ops.rope import RopeSpec, find_rope, rope_spec, rotate

from .cache import XKVCache
from .config import XKVConfig
from .group import XKVGroup, truncated_svd
from .latent import LatentKeys, LatentValues

__all__ = [
    "METHOD",
    "LatentKeys",
    "LatentValues",
    "RopeSpec",
    "XKVCache",
    "XKVConfig",
    "XKVGroup",
    "find_rope",
    "rope_spec",
    "rotate",
    "truncated_svd",
]

METHOD = Method.of(
    XKVCache,
    summary="cross-layer SVD: a token latent shared by adjacent layers, pre-RoPE keys",
    paper="https://arxiv.org/abs/2503.18893",
    recommended=({"layer_group": 2, "key_rank": 192, "value_rank": 256},),
)
