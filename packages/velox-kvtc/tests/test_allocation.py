"""KVTC's quantizers and bit allocation: the DP against brute force, its error predictions."""

import itertools

import mlx.core as mx
import numpy as np
import pytest

from velox_kvtc import Group, Plan, allocate, budget_bits, error_table
from velox_kvtc.codec import decode_rows, encode_rows
from velox_kvtc.quant import DTYPES, bits, dequantize, quantize


def _expanded(plan: Plan) -> list[tuple[int, int, str]]:
    """``(start, size, dtype)`` of a plan's groups, merged zero runs split into size 1."""
    out, at = [], 0
    for g in plan.groups:
        for _ in range(g.size if g.dtype == "zero" else 1):
            size = 1 if g.dtype == "zero" else g.size
            out.append((at, size, g.dtype))
            at += size
    return out


def _error(table, plan: Plan, components: int) -> float:
    total, end = 0.0, 0
    for start, size, dtype in _expanded(plan):
        total += table[(size, dtype)][start // size]
        end = start + size
    return total + sum(table[(1, "zero")][i] for i in range(end, components))


def _brute_force(table, components: int, budget: int) -> float:
    """Least error over every aligned tiling of the components with every type per tile."""
    options = sorted({(s, t) for s, t in table})
    best = np.inf

    def walk(i: int, cost: int, err: float) -> None:
        nonlocal best
        if cost > budget:
            return
        if i == components:
            best = min(best, err)
            return
        for s, t in options:
            if i % s == 0 and i + s <= components:
                walk(i + s, cost + bits(s, t), err + table[(s, t)][i // s])

    walk(0, 0, 0.0)
    return best


@pytest.mark.parametrize("seed", range(4))
def test_dp_is_optimal_against_brute_force(seed):
    rng = np.random.default_rng(seed)
    components, sizes, types = 8, (1, 2, 4), ("zero", "int1", "int2", "fp8")
    # random errors, decreasing with bits so that no type is useless; a dropped group costs
    # its components' energy (as on real rows: merged zero runs keep their error)
    unit = rng.gamma(2.0, 1.0, components)
    table = {}
    for s in sizes:
        energy = unit.reshape(-1, s).sum(axis=1)
        for t in types:
            shrink = {"zero": 1.0, "int1": 0.5, "int2": 0.2, "fp8": 0.01}[t]
            noise = 1.0 if t == "zero" else rng.uniform(0.5, 1.5, energy.size)
            table[(s, t)] = energy * shrink * noise
    for budget in (0, 8, 20, 33, 40, 70, 100, 200):
        plan = allocate(table, components, budget)
        assert plan.bits <= budget
        assert _error(table, plan, components) == pytest.approx(
            _brute_force(table, components, budget), rel=1e-12
        )


def _rows(n: int = 512, f: int = 64, seed: int = 0) -> mx.array:
    rng = np.random.default_rng(seed)
    scale = np.exp(-np.arange(f) / 12.0)  # decaying component variances, as after a PCA
    return mx.array((rng.standard_normal((n, f)) * scale).astype(np.float32))


def test_the_error_table_is_the_coders_error():
    """The DP's predicted error is what encoding and decoding those rows gives."""
    z = _rows()
    table = error_table(z, sizes=(1, 16, 64))
    eye, mean = mx.eye(z.shape[1]).astype(mx.float16), mx.zeros((z.shape[1],))
    for budget in (0, 40, 200, 400):
        plan = allocate(table, z.shape[1], budget)
        back = decode_rows(encode_rows(z, mean, eye, plan), z.shape[0], mean, eye, plan)
        got = float(mx.sum(mx.square(back - z)))
        assert got == pytest.approx(_error(table, plan, z.shape[1]), rel=1e-4)


def test_more_bits_never_cost_accuracy_and_stay_within_budget():
    z = _rows(seed=1)
    table = error_table(z, sizes=(1, 16, 64))
    errors = []
    for budget in range(0, 600, 37):
        plan = allocate(table, z.shape[1], budget)
        assert plan.bits <= budget
        errors.append(_error(table, plan, z.shape[1]))
    assert all(b <= a + 1e-9 for a, b in itertools.pairwise(errors))
    assert errors[0] == pytest.approx(float(mx.sum(z * z)), rel=1e-4)  # nothing stored


def test_high_variance_components_get_at_least_the_bits_of_later_ones():
    z = _rows(n=1024, f=128, seed=2)
    plan = allocate(error_table(z, sizes=(1, 16, 64)), 128, budget_bits(128, 8))
    widths = [bits(g.size, g.dtype) / g.size for g in plan.groups if g.dtype != "zero"]
    assert plan.groups and widths[0] == max(widths)
    assert plan.components < 128  # the trailing components are dropped


@pytest.mark.parametrize("dtype", [t for t in DTYPES if t.startswith("int")])
def test_integer_codes_err_by_at_most_half_a_step(dtype):
    x = _rows(n=64, f=16, seed=3) * 7.0
    codes, shift, scale = quantize(x, dtype)
    assert codes.dtype == mx.uint8 and int(mx.max(codes)) < 2 ** int(dtype[3:])
    err = mx.abs(dequantize(codes, dtype, shift, scale) - x)
    # the float16 shift may round away from the minimum by half its own ulp
    half_ulp = mx.abs(shift.astype(mx.float32))[:, None] * 2**-11
    slack = scale.astype(mx.float32)[:, None] / 2 + half_ulp
    assert bool(mx.all(err <= slack + 1e-6))


def test_constant_groups_and_fp8():
    x = mx.full((3, 16), 2.5)
    codes, shift, scale = quantize(x, "int2")
    assert bool(mx.all(dequantize(codes, "int2", shift, scale) == 2.5))
    y = _rows(n=8, f=16)
    codes, _, _ = quantize(y, "fp8")
    assert bool(mx.all(dequantize(codes, "fp8") == mx.from_fp8(mx.to_fp8(y), dtype=mx.float32)))
    assert bool(mx.all(dequantize(quantize(y, "zero")[0], "zero") == 0))


def test_budget_and_plan_json():
    assert budget_bits(1536, 16) == 1536 and budget_bits(100, 3) == 533
    plan = Plan((Group(64, "int4"), Group(3, "zero"), Group(1, "fp8")))
    assert Plan.from_json(plan.to_json()) == plan
    assert plan.bits == 64 * 4 + 32 + 8 and plan.components == 68
    for bad in ([[0, "int4"]], [[4, "int9"]], [["4", "int4"]], [[4]], {"a": 1}, [[True, "fp8"]]):
        with pytest.raises(ValueError):
            Plan.from_json(bad)
    with pytest.raises(ValueError, match="budget"):
        allocate({(1, "zero"): np.zeros(4)}, 4, -1)


def test_bits_of_each_type():
    for (size, dtype), want in {
        (16, "zero"): 0,
        (16, "int1"): 16 + 32,
        (64, "int4"): 256 + 32,
        (8, "fp8"): 64,
    }.items():
        assert bits(size, dtype) == want
    with pytest.raises(ValueError, match="int3"):
        bits(4, "int0")
    assert list(itertools.islice(DTYPES, 2)) == ["zero", "int1"]
