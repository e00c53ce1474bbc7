"""Retention policies (which tokens stay)."""

from .base import RetentionPolicy

__all__ = ["RetentionPolicy"]
