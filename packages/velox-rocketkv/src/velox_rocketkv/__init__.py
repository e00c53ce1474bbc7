"""velox-rocketkv: RocketKV, SnapKV++ eviction then hybrid sparse decode attention
(arXiv 2502.14051)."""

from velox_core.cache.eviction import eviction_method

from .cache import RocketKVCache
from .config import RocketKVConfig
from .pages import PageSummaries, summarize
from .policy import RocketKVPolicy
from .sparse import HybridSparse, select_tokens, step_reads
from .split import body_capacity, channels_for, page_for, paper_split, stage2_for, topk_for

__all__ = [
    "METHOD",
    "HybridSparse",
    "PageSummaries",
    "RocketKVCache",
    "RocketKVConfig",
    "RocketKVPolicy",
    "body_capacity",
    "channels_for",
    "page_for",
    "paper_split",
    "select_tokens",
    "stage2_for",
    "step_reads",
    "summarize",
    "topk_for",
]

METHOD = eviction_method(
    RocketKVCache,
    summary="SnapKV++ eviction at prefill (votes pooled over 63 tokens, one selection per KV "
    "head), then each decode step attends only its top-k kept tokens, picked by approximate "
    "scores from page key min/max summaries and the query's largest channels",
    paper="https://arxiv.org/abs/2502.14051",
)
