"""The per-layer allocator: optimal on hand-made tables (against brute force), within the
budget, refusing what it cannot do; sensitivity measured on tiny models; its layers build."""

import itertools
import json
import math

import numpy as np
import pytest
from mlx_lm.models.cache import KVCache, RotatingKVCache

from velox_cli.allocation import Allocation, SensitivityTable
from velox_cli.allocator import allocate, budget_bytes, sensitivity
from velox_cli.scoring import prefill, teacher_force
from velox_core import UniformCache, make_cache, routed
from velox_testing import tiny_model


def table(held, damage, specs=None, layers=None, elements=None) -> SensitivityTable:
    n, s = len(held), len(held[0])
    return SensitivityTable(
        specs=specs or [f"uniform:bits={b}" for b in (2, 3, 4, 5, 6, 7, 8)[:s]],
        layers=layers or list(range(n)),
        damage=damage,
        held=held,
        resident=held,
        base=[1024.0] * n,
        elements=elements or [512] * n,
        prompts=1,
        tail=8,
        tokens=100,
    )


def brute(t: SensitivityTable, budget: float) -> float:
    """The least summed damage of every choice within ``budget`` (inf: none)."""
    best = math.inf
    n = len(t.layers)
    for pick in itertools.product(range(len(t.specs)), repeat=n):
        cost = [t.held[i][k] for i, k in enumerate(pick)]
        if any(c is None for c in cost) or sum(cost) > budget * (1 + 1e-12):
            continue
        best = min(best, sum(t.damage[i][k] for i, k in enumerate(pick)))
    return best


def random_table(rng, n, s, holes=True) -> SensitivityTable:
    held = rng.uniform(10, 100, (n, s)).round(rng.integers(0, 3)).tolist()
    damage = rng.exponential(1.0, (n, s)).tolist()
    if holes:  # a spec that does not serve a layer; every layer keeps one choice
        for i in range(n):
            for k in range(1, s):
                if rng.random() < 0.2:
                    held[i][k] = damage[i][k] = None
    return table(held, damage)


@pytest.mark.parametrize("seed", range(40))
def test_allocation_is_optimal_against_brute_force_and_meets_the_budget(seed):
    rng = np.random.default_rng(seed)
    t = random_table(rng, int(rng.integers(1, 6)), int(rng.integers(1, 5)))
    cheapest = sum(min(c for c in r if c is not None) for r in t.held)
    dearest = sum(max(c for c in r if c is not None) for r in t.held)
    for budget in np.linspace(cheapest, dearest * 1.05, 7):
        plan = allocate(t, float(budget))
        chosen = [t.specs.index(plan.layers[i]) for i in t.layers]
        cost = sum(t.held[i][k] for i, k in enumerate(chosen))
        harm = sum(t.damage[i][k] for i, k in enumerate(chosen))
        assert cost <= budget * (1 + 1e-12) and plan.bytes_per_token == pytest.approx(cost)
        assert plan.damage == pytest.approx(harm)
        assert harm == pytest.approx(brute(t, float(budget)), rel=1e-12, abs=1e-15)


def test_equal_bytes_choices_many_layers_stay_exact():
    """Layers of one shape cost the same per spec: ties in bytes everywhere."""
    rng = np.random.default_rng(7)
    held = [[20.0, 30.0, 40.0, 70.0] for _ in range(6)]
    damage = [sorted(rng.exponential(1.0, 4).tolist(), reverse=True) for _ in range(6)]
    t = table(held, damage)
    for budget in (120, 150, 185, 200, 260, 420):
        assert allocate(t, budget).damage == pytest.approx(brute(t, budget))


def test_a_sensitive_layer_gets_the_finer_spec():
    t = table([[10.0, 20.0], [10.0, 20.0]], [[1.0, 0.1], [5.0, 0.5]])
    plan = allocate(t, 30.0)
    assert plan.layers == {0: "uniform:bits=2", 1: "uniform:bits=3"}
    assert plan.default in plan.layers.values() and plan.budget == 30.0


def test_a_budget_named_by_a_spec_is_its_bytes_on_every_layer_and_fits_it():
    t = table([[10.0, 15.0, 20.0], [10.0, 15.0, 20.0]], [[4.0, 1.0, 0.2], [0.4, 0.1, 0.02]])
    assert budget_bytes(t, "uniform:bits=3") == 30.0
    plan = allocate(t, "uniform:bits=3")  # exactly at the budget: feasible
    assert plan.bytes_per_token <= 30.0 and plan.damage <= 1.1
    assert budget_bytes(t, "2bits") == pytest.approx(2 / 8 * 1024)  # 2 layers x 512 channels
    assert budget_bytes(t, "2.5 bits") == pytest.approx(2.5 / 8 * 1024)


def test_only_the_specs_asked_are_chosen():
    t = table([[10.0, 15.0, 20.0], [10.0, 15.0, 20.0]], [[4.0, 1.0, 0.2], [0.4, 0.1, 0.02]])
    plan = allocate(t, "uniform:bits=3", ["uniform:bits=2", "uniform:bits=4"])
    assert set(plan.layers.values()) <= {"uniform:bits=2", "uniform:bits=4"}
    assert plan.layers == {0: "uniform:bits=4", 1: "uniform:bits=2"}
    assert plan.specs == ["uniform:bits=2", "uniform:bits=4"]


def test_resolution_rounds_bytes_up_and_still_meets_the_budget():
    t = table([[1.0, 1.5], [1.0, 1.5]], [[1.0, 0.0], [1.0, 0.0]])
    assert allocate(t, 2.5).damage == 1.0  # one layer at 1.5 bytes
    rounded = allocate(t, 2.5, resolution=1.0)  # 1.5 counts as 2: only 1 + 1 fits
    assert rounded.damage == 2.0 and rounded.bytes_per_token == 2.0
    for bad, err in ((-1.0, ValueError), (math.inf, ValueError), ("1", TypeError)):
        with pytest.raises(err, match="resolution"):
            allocate(t, 2.5, resolution=bad)


@pytest.mark.parametrize(
    "budget,specs,err,match",
    [
        (19.9, None, ValueError, "below the cheapest allocation, 20.0"),
        (0, None, ValueError, "positive"),
        (-5, None, ValueError, "positive"),
        (math.nan, None, ValueError, "positive"),
        ("lots", None, ValueError, "give bytes per token, 'Nbits'"),
        ("uniform:bits=9", None, ValueError, "one of the table's specs"),
        (True, None, TypeError, "budget"),
        ([3], None, TypeError, "budget"),
        (30, ["uniform:bits=9"], ValueError, "not in the table"),
        (30, "uniform:bits=2", TypeError, "specs"),
        (30, ["uniform:bits=3"], ValueError, r"serves layers \[1\]"),
    ],
)
def test_refusals(budget, specs, err, match):
    t = table([[10.0, 15.0], [10.0, None]], [[1.0, 0.5], [1.0, None]])
    with pytest.raises(err, match=match):
        allocate(t, budget, specs)


def test_tables_and_allocations_round_trip_through_json(tmp_path):
    t = table([[10.0, None], [10.0, 12.5]], [[1.0, None], [0.25, math.inf]])
    t.save(tmp_path / "t.json")
    back = SensitivityTable.load(tmp_path / "t.json")
    assert back == t
    plan = allocate(back, 25.0)
    plan.save(tmp_path / "a.json")
    assert Allocation.load(tmp_path / "a.json") == plan
    doc = json.loads((tmp_path / "a.json").read_text())
    assert doc["layers"] == {"0": "uniform:bits=2", "1": "uniform:bits=2"}
    by_hand = Allocation.from_json({"default": "uniform:bits=4", "layers": {"-1": "fp16"}})
    assert by_hand.layers == {-1: "fp16"} and by_hand.damage is None


@pytest.mark.parametrize(
    "doc,match",
    [
        ([], "JSON object"),
        ({"format": "other", "default": "a", "layers": {}}, "not an allocation"),
        ({"version": 2, "default": "a", "layers": {}}, "version"),
        ({"default": "a", "layers": {"x": "b"}}, "'index': 'spec'"),
        ({"default": "a", "layers": {"0": 4}}, "'index': 'spec'"),
        ({"default": None, "layers": {}}, "'default'"),
        ({"default": "a", "layers": {}, "damage": "low"}, "'damage' must be a number"),
        ({"default": "a", "layers": {}, "colour": 1}, "colour"),
    ],
)
def test_bad_allocation_files_are_refused(doc, match):
    with pytest.raises(ValueError, match=match):
        Allocation.from_json(doc)


def test_bad_tables_are_refused(tmp_path):
    good = table([[10.0]], [[1.0]]).to_json()
    for change, match in (
        ({"format": "x"}, "not a sensitivity table"),
        ({"version": 9}, "version"),
        ({"held": [[10.0, 1.0]]}, "held must be 1 layers x 1 specs"),
        ({"held": [[None]]}, "None together"),
        ({"held": [[-1.0]]}, "finite and >= 0"),
        ({"specs": []}, "at least one"),
        ({"bogus": 1}, "bogus"),
    ):
        with pytest.raises(ValueError, match=match):
            SensitivityTable.from_json({**good, **change})
    (tmp_path / "x.json").write_text("{not json")
    with pytest.raises(ValueError, match="not JSON"):
        SensitivityTable.load(tmp_path / "x.json")
    with pytest.raises(FileNotFoundError):
        Allocation.load(tmp_path / "missing.json")


# -- sensitivity on tiny random models ----------------------------------------------------

MODEL = tiny_model("llama")  # two layers, head dim 64, 2 KV heads
PROMPTS = [np.random.default_rng(s).integers(0, 512, 72).tolist() for s in (0, 1)]
SPECS = ["uniform:bits=2", "uniform:bits=8", "fp16"]


@pytest.fixture(scope="module")
def measured():
    lines = []
    t = sensitivity(MODEL, PROMPTS, SPECS, tail=6, chunk=32, progress=lines.append)
    return t, lines


def test_sensitivity_ranks_a_coarser_cache_as_more_damaging(measured):
    t, lines = measured
    assert t.layers == [0, 1] and t.specs == SPECS and t.prompts == 2 and t.tail == 6
    assert t.tokens == 71 and t.elements == [2 * (64 + 64)] * 2
    for i in range(2):
        two, eight, fp16 = t.damage[i]
        assert two > 10 * eight > 0 and fp16 == 0.0
        assert t.held[i][0] < t.held[i][1] < t.held[i][2] == t.base[i]
        assert all(r >= h for r, h in zip(t.resident[i], t.held[i]))
    assert t.base[0] == 2 * 2 * 64 * 2  # keys and values, 2 heads x 64 channels, fp16
    assert len(lines) == 4 and lines[0].startswith("layer 0 uniform:bits=2: KL")


def test_bytes_are_the_real_caches_held_bytes(measured):
    """A 2-bit layer's bytes per token are what its cache holds after each prompt's run
    (codes, scales, the tokens the flush has not coded yet), over the tokens it saw: above
    the nominal 2 bits a channel, below the fp16 cache's."""
    t, _ = measured
    held = 0
    for p in PROMPTS:
        caches = make_cache(MODEL, None, layers={1: "uniform:bits=2"})
        with routed(MODEL):
            logits = prefill(MODEL, caches, p[:-6], 32)
            teacher_force(MODEL, caches, logits, p[-6:])
        assert isinstance(caches[1], UniformCache) and caches[1].offset == 71
        held += caches[1].logical_nbytes
    assert t.held[1][0] == held / (2 * 71)
    assert t.elements[1] * 2 / 8 < t.held[1][0] < t.base[1]


def test_the_allocation_builds_caches(measured):
    t, _ = measured
    plan = allocate(t, "uniform:bits=8", ["uniform:bits=2", "uniform:bits=8"])
    assert plan.layers == {0: "uniform:bits=8", 1: "uniform:bits=8"}
    plan = allocate(t, (t.held[0][0] + t.held[1][1]) * 1.0001, ["uniform:bits=2", "uniform:bits=8"])
    caches = make_cache(MODEL, plan.default, layers=plan.layers)
    bits = {i: caches[i].tiers[0].key_codec.bits for i in (0, 1)}
    assert sorted(bits.values()) == [2, 8]
    worse = 0 if t.damage[0][0] > t.damage[1][0] else 1  # the finer codes go where 2 bits hurt
    assert bits[worse] == 8


def test_sliding_window_layers_are_left_out_and_keep_their_cache():
    model = tiny_model("gemma3")  # layers 0 and 2 attend over a sliding window
    prompts = [np.random.default_rng(3).integers(0, 512, 40).tolist()]
    t = sensitivity(model, prompts, ["uniform:bits=2", "uniform:bits=4"], tail=4, chunk=16)
    assert t.layers == [1, 3]
    plan = allocate(t, "uniform:bits=4")
    caches = make_cache(model, plan.default, layers=plan.layers)
    assert [type(c) for c in caches] == [RotatingKVCache, UniformCache] * 2


@pytest.mark.parametrize(
    "prompts,specs,kw,err,match",
    [
        ([], SPECS, {}, ValueError, "at least one prompt"),
        ("some text", SPECS, {}, TypeError, "token id"),
        (["some text"], SPECS, {}, TypeError, "tokenizer.encode"),
        ([[1.5, 2.5] * 20], SPECS, {}, TypeError, "1-D sequence of token ids"),
        ([[1, 2, 3]], SPECS, {"tail": 3}, ValueError, "more than tail=3"),
        (PROMPTS, [], {}, ValueError, "at least one candidate"),
        (PROMPTS, "uniform:bits=2", {}, TypeError, "list of spec strings"),
        (PROMPTS, ["nope:bits=2"], {}, ValueError, "unknown method 'nope'"),
        (PROMPTS, ["uniform:bitz=2"], {}, ValueError, "no parameter 'bitz'"),
        (PROMPTS, ["uniform:bits=2", "uniform:bits=2"], {}, ValueError, "more than once"),
        (PROMPTS, [KVCache()], {}, TypeError, "spec string"),
        (PROMPTS, ["fp16"], {}, ValueError, "no layer"),
        (PROMPTS, SPECS, {"tail": 0}, ValueError, "tail"),
        (PROMPTS, SPECS, {"chunk": 1.5}, TypeError, "chunk"),
    ],
)
def test_sensitivity_refusals(prompts, specs, kw, err, match):
    with pytest.raises(err, match=match):
        sensitivity(MODEL, prompts, specs, **kw)


def test_a_spec_with_a_step_over_every_layer_is_refused():
    pytest.importorskip("velox_kvzip", reason="needs velox-kvzip")
    with pytest.raises(ValueError, match="after the prefill over every layer"):
        sensitivity(MODEL, PROMPTS, ["kvzip:budget=32"])
