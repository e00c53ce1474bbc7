"""Test helpers shipped with velox-core: the conformance suite and tiny models.

Importing this module needs pytest (the ``test`` extra).
"""

from .baselines import attention_errors_vs_mlx_quant, fill_chunks
from .conformance import (
    CacheConformance,
    assert_partials_close,
    assert_partials_equivalent,
    greedy_agreement,
    kv_data,
    rel_error,
)
from .kernel_env import kernel_env
from .models import FAMILIES, tiny_model, tiny_tokenizer

__all__ = [
    "FAMILIES",
    "CacheConformance",
    "assert_partials_close",
    "assert_partials_equivalent",
    "attention_errors_vs_mlx_quant",
    "fill_chunks",
    "greedy_agreement",
    "kernel_env",
    "kv_data",
    "rel_error",
    "tiny_model",
    "tiny_tokenizer",
]
