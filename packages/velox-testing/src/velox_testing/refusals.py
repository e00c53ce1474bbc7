"""Checks that a method refuses what it cannot do up front, in its own words."""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Sequence

import pytest

from velox_core import make_cache

from .models import conformance_model

__all__ = [
    "assert_head_dim_refused",
    "assert_spec_refused",
    "assert_tampered_state_refused",
    "spec_refusals_test",
]


def assert_head_dim_refused(method: str, why: str, fits: str, head_dim: int = 80) -> None:
    """``make_cache`` refuses a head dim the method's defaults cannot code, before the first
    forward, in the method's own terms (its parameter, not the codec underneath), and the
    spec ``fits`` codes it.

    Args:
        method: the method's name, the spec of its defaults.
        why: the reason the message gives after ``"<method>: "`` (plain text).
        fits: a spec of the method that codes ``head_dim``.
        head_dim: the tiny llama's head dim.
    """
    model = conformance_model(head_dim)
    where = re.escape(f"layer 0 (head dim {head_dim}): {method}: {why}")
    with pytest.raises(ValueError, match=where) as err:
        make_cache(model, method)
    assert "uniform:" not in str(err.value)  # not the codec's words
    assert all(c.method == method for c in make_cache(model, fits))


def assert_spec_refused(spec: str, match: str, head_dim: int = 128) -> None:
    """``make_cache`` refuses ``spec`` for the conformance model (head dim ``head_dim``) with
    a ``ValueError`` whose message matches ``match`` (a regex)."""
    model = conformance_model(head_dim)
    with pytest.raises(ValueError, match=match):
        make_cache(model, spec)


def spec_refusals_test(bad: Sequence[tuple[str, str]]) -> Callable[[str, str], None]:
    """A test, parametrized over ``bad`` (``(spec, match)`` pairs), that ``make_cache``
    refuses each spec with a message matching its regex (:func:`assert_spec_refused`). A test
    module binds it once: ``test_make_cache_refuses_bad_parameters_naming_them =
    spec_refusals_test(BAD)``."""

    @pytest.mark.parametrize("spec,match", bad)
    def test(spec: str, match: str) -> None:
        assert_spec_refused(spec, match)

    return test


def assert_tampered_state_refused(cache, name: str, match: str) -> None:
    """A state of ``cache`` whose array ``name`` (``"codec.tier0.k.proj"``...) is negated does
    not load: ``from_state`` raises a ``ValueError`` matching ``match`` (a seeded array that
    the codec rebuilds from its seed must agree with it)."""
    state = cache.state
    i = 1 + json.loads(state[0])["arrays"].index(name)
    state[i] = state[i] * -1
    with pytest.raises(ValueError, match=match):
        type(cache).from_state(state)
