"""Issue 55: at its defaults (no ``every``) nestedkv's cache grows through decode without bound;
like SnapKV it warns once (per policy class and process) when it holds twice its budget."""

import warnings

import pytest

from velox_core import routed
from velox_core.policy import base
from velox_nestedkv import NestedKVCache
from velox_testing import feed, kv_data

BUDGET = 128


def _decode_warnings(cache, steps: int) -> list[warnings.WarningMessage]:
    """UserWarnings of a 40-token prompt (under the budget: nothing to evict) then ``steps``
    single-token decode updates."""
    k, v = kv_data(t=40 + steps)
    base._WARNED.discard(cache.policy.name)
    with warnings.catch_warnings(record=True) as seen, routed():  # per-head budgets
        warnings.simplefilter("always")
        feed(cache, k, v, (40, *([1] * steps)))
    return [w for w in seen if issubclass(w.category, UserWarning)]


def test_unbounded_decode_warns_once_naming_every():
    cache = NestedKVCache(budget=BUDGET)
    seen = _decode_warnings(cache, 3 * BUDGET)  # past twice the budget
    assert cache.size() > 2 * BUDGET  # decode tokens accumulate without every
    assert len(seen) == 1, [str(w.message) for w in seen]
    assert "every" in str(seen[0].message) and f"budget={BUDGET}" in str(seen[0].message)
    # once per process: a second unbounded cache of the same class stays silent
    with warnings.catch_warnings(record=True) as again, routed():
        warnings.simplefilter("always")
        k, v = kv_data(t=40 + 3 * BUDGET)
        feed(NestedKVCache(budget=BUDGET), k, v, (40, *([1] * 3 * BUDGET)))
    assert not [w for w in again if issubclass(w.category, UserWarning)]


@pytest.mark.parametrize("steps", [0, BUDGET, 2 * BUDGET - 41])
def test_no_warning_below_twice_the_budget_or_with_every(steps):
    assert _decode_warnings(NestedKVCache(budget=BUDGET), steps) == []
    bounded = NestedKVCache(budget=BUDGET, every=16)
    assert _decode_warnings(bounded, 3 * BUDGET) == []
