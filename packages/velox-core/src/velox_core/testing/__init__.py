"""Test helpers shipped with velox-core: the conformance suite and tiny models.

Importing this module needs pytest (the ``test`` extra).
"""

from .conformance import CacheConformance, greedy_agreement, kv_data, rel_error
from .models import FAMILIES, tiny_model, tiny_tokenizer

__all__ = [
    "FAMILIES",
    "CacheConformance",
    "greedy_agreement",
    "kv_data",
    "rel_error",
    "tiny_model",
    "tiny_tokenizer",
]
