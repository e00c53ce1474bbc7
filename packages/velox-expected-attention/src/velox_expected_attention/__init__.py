"""velox-expected-attention: keep the tokens future queries are expected to attend to
(arXiv 2510.00636, NVIDIA kvpress's ExpectedAttentionPress)."""

from velox_core.cache.eviction import eviction_method

from .cache import ExpectedAttentionCache
from .config import ExpectedAttentionConfig
from .policy import ExpectedAttentionPolicy, expected_attention_scores, model_rope
from .stats import QueryStats, average_rotation

__all__ = [
    "METHOD",
    "ExpectedAttentionCache",
    "ExpectedAttentionConfig",
    "ExpectedAttentionPolicy",
    "QueryStats",
    "average_rotation",
    "expected_attention_scores",
    "model_rope",
]

METHOD = eviction_method(
    ExpectedAttentionCache,
    summary=(
        "per KV head, the tokens of highest expected attention under a Gaussian model of the "
        "future queries (times the value norm); rest evicted"
    ),
    paper="https://arxiv.org/abs/2510.00636",
)
