"""Shared helpers of the CacheGen tests: a tiny model and caches prefilled on it."""

from __future__ import annotations

from functools import lru_cache

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import KVCache

from velox_cachegen.chunks import read_meta
from velox_cachegen.container import split
from velox_cachegen.header import chunk_count
from velox_testing import conformance_model, kv_caches_after, random_prompt, scratch_dir

HEAD_DIM = 32  # 2 layers x 2 KV heads x 32 channels: 64 channels per layer-side
TMP = scratch_dir("velox-cachegen-tests-")


@lru_cache(maxsize=1)
def model():
    return conformance_model(head_dim=HEAD_DIM)


def prompt(tokens: int = 200, seed: int = 5, batch: int = 1) -> mx.array:
    return random_prompt(tokens, seed, batch)


def prefilled(tokens: int = 200, seed: int = 5, batch: int = 1, dtype=mx.float16) -> list:
    """mlx-lm caches of the tiny model after a random prompt, stored in ``dtype``."""
    return kv_caches_after(model(), prompt(tokens, seed, batch), dtype)


def synthetic(tokens: int, layers: int = 2, heads: int = 2, dim: int = 16, walk=True, seed=0):
    """KVCache layers holding a random walk along the tokens (strong token-wise locality) or
    independent Gaussian tokens."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(layers):
        pair = []
        for _ in range(2):
            x = rng.standard_normal((1, heads, tokens, dim)).astype(np.float32)
            if walk:
                x = np.cumsum(x * 0.05, axis=2) + 3 * rng.standard_normal((1, heads, 1, dim))
            pair.append(mx.array(x).astype(mx.float16))
        c = KVCache()
        c.state = (*pair, tokens)
        out.append(c)
    return out


def metas(data: bytes) -> list[dict]:
    """Each chunk's JSON header and sections."""
    _, frames = split(data, chunk_count)
    return [read_meta(f) for f in frames]
