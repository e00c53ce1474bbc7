"""Checks that a method refuses what it cannot do up front, in its own words: the bad
settings the conformance suites try (:data:`SHARED_BAD`, :data:`EVICTION_BAD`, and for the
presets that add them :data:`VOTE_BAD` and :data:`RECENT_BAD`), the helpers that write a
suite's ``bad_settings``, and refusals of specs, head dims and tampered states."""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Sequence
from typing import Any

import pytest

from velox_core import make_cache

from .models import conformance_model

__all__ = [
    "EVICTION_BAD",
    "RECENT_BAD",
    "SHARED_BAD",
    "VOTE_BAD",
    "assert_head_dim_refused",
    "assert_spec_refused",
    "assert_tampered_state_refused",
    "int_refusals",
    "named_refusals",
    "share_refusals",
    "spec_refusals_test",
]

# a ``bad_settings`` entry of :class:`velox_testing.CacheConformance`: settings its cache class
# refuses, and a regex the message matches
Refusal = tuple[dict[str, Any], str]


def named_refusals(**bad: Any) -> tuple[Refusal, ...]:
    """``bad_settings`` entries of settings refused in the parameter's name: each keyword's
    value (or each value of a list) alone is refused with a message naming the keyword.

    ``named_refusals(theta=[0.0, 1.5], window=0)`` is ``(({"theta": 0.0}, "theta"),
    ({"theta": 1.5}, "theta"), ({"window": 0}, "window"))``; a bad value that is itself a
    list is given in a list of its own.
    """
    return tuple(
        ({name: value}, re.escape(name))
        for name, values in bad.items()
        for value in (values if isinstance(values, list) else [values])
    )


def int_refusals(**ranges: tuple[int | None, int | None]) -> tuple[Refusal, ...]:
    """``bad_settings`` entries of int parameters with a range, in the words of
    ``velox_core.validation.check_int``: for ``name=(minimum, maximum)`` (None: no bound),
    ``minimum - 1`` is refused with ``"<name> must be >= <minimum>"``, ``maximum + 1`` with
    ``"<name> must be <= <maximum>"``, and the floats ``minimum + 0.5`` and ``minimum``
    (without a minimum: 0.5 and 0.0) with ``"<name> must be an int"``."""
    out: list[Refusal] = []
    for name, bounds in ranges.items():
        if not (isinstance(bounds, tuple) and len(bounds) == 2):
            raise TypeError(f"{name}: give (minimum, maximum), each an int or None; got {bounds!r}")
        minimum, maximum = bounds
        if minimum is not None:
            out.append(({name: minimum - 1}, f"{name} must be >= {minimum}"))
        if maximum is not None:
            out.append(({name: maximum + 1}, f"{name} must be <= {maximum}"))
        low = 0 if minimum is None else minimum
        for value in (low + 0.5, float(low)):
            out.append(({name: value}, f"{name} must be an int"))
    return tuple(out)


def share_refusals(name: str) -> tuple[Refusal, ...]:
    """``bad_settings`` entries of a parameter that takes a share of the budget, a whole
    number of tokens or a fraction in ``[0, 1)`` (``velox_core.cache.eviction.recent_tokens``:
    H2O's and Keyformer's ``recent``, CaM's ``sinks``): a negative count and fraction, the
    fractions 1.0 and 2.5, a bool, a string, None and NaN, each refused naming ``name``."""
    return named_refusals(**{name: [-1, -0.5, 1.0, 2.5, True, "half", None, float("nan")]})


# bad values of the settings velox cache classes share (the shared parameter names, the
# standalone RoPE settings of velox_core.codec.prerope) and a name none has: the conformance
# suite tries those whose parameters a class has all of
SHARED_BAD: tuple[Refusal, ...] = (
    *named_refusals(
        window=-1,
        sinks=-1,
        flush=0,
        check_finite=1,
        seed=-1,
        budget=0,
        group=0,
        calibration=0,
        bits=[0, 9, "4", True],
        key_bits=9,
        value_bits=9,
        rope_base=1.0,
    ),
    ({"rope_traditional": True}, "rope_base"),  # without rope_base
    ({"rope_base": 10000.0, "rope_dims": 63}, "rope_dims"),
    ({"rope_base": 10000.0, "rope_scale": 0.0}, "rope_scale"),
    ({"pre_rope": False, "rope_base": 10000.0}, "pre_rope"),
    *named_refusals(no_such_parameter=1),
)

# bad values of the settings eviction presets share (velox_core.cache.eviction.EvictionConfig),
# beside SHARED_BAD: each refused, the message naming the setting (velox_testing.eviction's
# suites try them)
EVICTION_BAD: tuple[Refusal, ...] = (
    ({"budget": 8, "sinks": 4, "window": 4}, "budget"),  # nothing left for the policy
    ({"budget": 8, "sinks": 8}, "budget"),
    ({"every": 0}, "every"),
    ({"bits": 1}, "bits"),  # the kept tokens' codes take 2 to 8 bits
    ({"key_bits": 4}, "key_bits"),  # without bits
    ({"compression_ratio": 0.5}, "compression_ratio"),  # kvpress's: velox counts tokens
)

# bad values of an eviction preset's recent window (``recent``, a share of the budget; the
# tokens always kept must leave room for one scored token), for the bad_settings of the
# presets that keep one: each refused, the message naming the setting
RECENT_BAD: tuple[Refusal, ...] = (
    *share_refusals("recent"),
    ({"budget": 64, "recent": 64}, "recent"),  # no scored token would fit
)

# bad values of the settings of a policy voting with an observation window (SnapKV's rule,
# velox_core.policy.voting: 32 queries by default), for the bad_settings of the presets that
# vote with it: each refused, the message naming the setting
VOTE_BAD: tuple[Refusal, ...] = (
    ({"budget": 32}, "budget"),  # no room beyond the 32-token observation window
    ({"budget": 40, "sinks": 8}, "budget"),
    *named_refusals(observe=0, kernel=4, pooling="mean"),
    ({"window_size": 32}, "window_size"),  # kvpress's name of observe
)


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
