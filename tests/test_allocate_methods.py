"""The per-layer allocator with other methods' specs: each family's coarser setting measures
as more damaging and cheaper on every layer, and a table of several families allocates into
caches that build (velox_cli.allocator is usable by any method, not only ``uniform``)."""

import numpy as np
import pytest

from velox_cli.allocator import allocate, sensitivity
from velox_core import VeloxCache, make_cache
from velox_testing import tiny_model

MODEL = tiny_model("llama")
PROMPTS = [np.random.default_rng(0).integers(0, 512, 200).tolist()]
FAMILIES = [
    ("velox_turboquant", ["turboquant:bits=2", "turboquant:bits=4"]),
    ("velox_kivi", ["kivi:bits=2,group=32,window=16", "kivi:bits=4,group=32,window=16"]),
    ("velox_snapkv", ["snapkv:budget=48", "snapkv:budget=128"]),
]


@pytest.mark.parametrize("package,specs", FAMILIES, ids=[f[0] for f in FAMILIES])
def test_a_coarser_setting_of_each_family_costs_more_and_holds_less(package, specs):
    pytest.importorskip(package)
    t = sensitivity(MODEL, PROMPTS, specs, tail=8, chunk=64)
    assert t.layers == [0, 1]
    for damage, held in zip(t.damage, t.held, strict=True):
        assert damage[0] > damage[1] > 0 and held[0] < held[1]


def test_a_table_of_several_families_allocates_into_caches():
    pytest.importorskip("velox_turboquant")
    pytest.importorskip("velox_kivi")
    specs = ["turboquant:bits=3", "kivi:bits=2,group=32,window=16", "uniform:bits=8"]
    t = sensitivity(MODEL, PROMPTS, specs, tail=8, chunk=64)
    cheapest = min(t.held[0]) + min(t.held[1])
    dearest = max(t.held[0]) + max(t.held[1])
    for budget in np.linspace(cheapest, dearest, 5):
        plan = allocate(t, float(budget))
        assert plan.bytes_per_token <= budget * (1 + 1e-9)
        caches = make_cache(MODEL, plan.default, layers=plan.layers)
        for i, spec in plan.layers.items():
            assert isinstance(caches[i], VeloxCache) and caches[i].method == spec.split(":")[0]
