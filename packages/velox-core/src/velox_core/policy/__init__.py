"""Retention policies (which tokens stay; each reads its cache only through the
:class:`~velox_core.policy.view.PolicyView` its hooks are given), and the pieces of those
that score tokens by attention: the vote maths (:mod:`.votes`), the buffered queries
(:mod:`.window`), SnapKV-style voting (:mod:`.voting`) and votes accumulated over every
query (:mod:`.accumulated`)."""

from .accumulated import AccumulatedPolicy
from .base import top_k_sorted
from .votes import WindowVote, check_fusion, pool_votes, window_votes
from .voting import WindowVotePolicy
from .window import QueryWindow

__all__ = [
    "AccumulatedPolicy",
    "QueryWindow",
    "WindowVote",
    "WindowVotePolicy",
    "check_fusion",
    "pool_votes",
    "top_k_sorted",
    "window_votes",
]
