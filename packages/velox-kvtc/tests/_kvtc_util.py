"""Shared helpers of the KVTC tests: a tiny model, its fitted basis, prefilled caches."""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

import mlx.core as mx
import numpy as np

from velox_kvtc import KvtcBasis, fit_kvtc, save_basis
from velox_testing import conformance_model, kv_caches_after, random_prompt, scratch_dir

HEAD_DIM = 32  # 2 layers x 2 KV heads x 32 channels: rows of 128 features
RATIOS = (3.0, 4.0, 8.0)
SINKS, WINDOW = 4, 16
_TMP = scratch_dir("velox-kvtc-tests-")


@lru_cache(maxsize=1)
def model():
    return conformance_model(head_dim=HEAD_DIM)


@lru_cache(maxsize=1)
def basis() -> KvtcBasis:
    """Fitted on 6 sequences of 256 random tokens (2 held out)."""
    ids = np.random.default_rng(0).integers(0, 512, 6 * 256)
    return fit_kvtc(model(), ids, seq_len=256, ratios=RATIOS, sinks=SINKS, window=WINDOW)


@lru_cache(maxsize=1)
def basis_file() -> str:
    return str(save_basis(basis(), _TMP / "basis.safetensors"))


def prompt(tokens: int = 200, seed: int = 5, batch: int = 1) -> mx.array:
    return random_prompt(tokens, seed, batch)


def prefilled(tokens: int = 200, seed: int = 5, batch: int = 1, dtype=mx.float16) -> list:
    """mlx-lm caches of the tiny model after a random prompt, stored in ``dtype``."""
    return kv_caches_after(model(), prompt(tokens, seed, batch), dtype)


def tmp(name: str) -> Path:
    return _TMP / name
