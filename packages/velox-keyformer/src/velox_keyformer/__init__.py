"""velox-keyformer: keep the recent tokens and the key tokens of accumulated Gumbel-softmax
scores (arXiv 2403.09054)."""

from velox_core.cache.eviction import eviction_method

from .cache import KeyformerCache
from .config import KeyformerConfig
from .policy import KeyformerPolicy
from .score import gumbel_votes, temperature

__all__ = [
    "METHOD",
    "KeyformerCache",
    "KeyformerConfig",
    "KeyformerPolicy",
    "gumbel_votes",
    "temperature",
]

METHOD = eviction_method(
    KeyformerCache,
    summary="recent tokens plus key tokens of accumulated Gumbel-softmax scores (temperature "
    "rising over the decode), per KV head; one eviction per step",
    paper="https://arxiv.org/abs/2403.09054",
)
