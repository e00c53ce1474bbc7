"""Retention policies (which tokens stay)."""

from .base import RetentionPolicy, top_k_sorted

__all__ = ["RetentionPolicy", "top_k_sorted"]
