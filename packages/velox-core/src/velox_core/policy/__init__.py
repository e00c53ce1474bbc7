"""Retention policies (which tokens stay)."""

from .base import RetentionPolicy, top_k_sorted
from .votes import WindowVote, pool_votes, window_votes

__all__ = ["RetentionPolicy", "WindowVote", "pool_votes", "top_k_sorted", "window_votes"]
