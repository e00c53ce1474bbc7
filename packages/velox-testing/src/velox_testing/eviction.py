"""The conformance suite's bounds for eviction presets (``budget`` tokens per KV head).

An eviction method's tests run the suite twice: :class:`FullBudgetConformance` with a budget
above every length the suite stores (nothing is evicted: attention equals fp16's), and
:class:`EvictingConformance` with a small budget (most of the context is evicted: bounded
memory, no fp16 reference over all tokens). Both also check that the class refuses bad values
of the settings eviction presets share (:data:`EVICTION_BAD`). Subclasses define ``make``;
:class:`Routed` runs every test of a class under routed attention, for policies that see
queries only there.
"""

from __future__ import annotations

from typing import Any

import pytest

from velox_core import routed

from .conformance import CacheConformance

__all__ = ["EVICTION_BAD", "EvictingConformance", "FullBudgetConformance", "Routed"]


# bad values of the settings eviction presets share (velox_core.cache.eviction.EvictionConfig),
# beside the suite's SHARED_BAD: each refused, the message naming the setting
EVICTION_BAD: tuple[tuple[dict[str, Any], str], ...] = (
    ({"budget": 8, "sinks": 4, "window": 4}, "budget"),  # nothing left for the policy
    ({"every": 0}, "every"),
    ({"bits": 1}, "bits"),  # the kept tokens' codes take 2 to 8 bits
    ({"key_bits": 4}, "key_bits"),  # without bits
)


class _Eviction(CacheConformance):
    """The suite for an eviction preset: the shared bad settings include :data:`EVICTION_BAD`."""

    def shared_bad_settings(self, cls: type) -> list[tuple[dict[str, Any], str]]:
        return [*super().shared_bad_settings(cls), *EVICTION_BAD]


class FullBudgetConformance(_Eviction):
    """A budget above the suite's lengths: nothing is evicted, attention is fp16's."""

    max_memory_ratio = 1.01  # fp16 tokens plus the body's int32 positions
    attention_error = 5e-3
    model_logit_cosine = 0.9999
    same_greedy_tokens = 32


class EvictingConformance(_Eviction):
    """A small budget: evicting, lossy, bounded."""

    max_memory_ratio = 0.1  # measured right after a 512-token chunk: budget + chunk are held
    attention_error = None  # most of the context is evicted: no fp16 reference applies
    model_logit_cosine = 0.5


class Routed:
    """Mixin: every test of the class runs inside ``velox_core.routed()`` (a policy that
    votes with the queries sees them only through velox attention)."""

    @pytest.fixture(autouse=True)
    def _routed(self):
        with routed():
            yield
