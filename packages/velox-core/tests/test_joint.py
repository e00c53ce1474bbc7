"""``velox_core.kernels.joint.plan_joint``: the joint run a codec's plan returns."""

from __future__ import annotations

import mlx.core as mx

from velox_core.kernels import decode as dk
from velox_core.kernels.joint import JointQuery, plan_joint


def _fake_plans(monkeypatch):
    made = []

    def fake_plan(q_shape, q_dtype, keys, values, **kw):
        def run(q, fp16=None, merge_q=None, q_sketch=None):
            return ("o", q_dtype, q, merge_q, q_sketch)

        made.append((q_dtype, kw, run))
        return run

    monkeypatch.setattr(dk, "plan_decode", fake_plan)
    return made


def test_an_unprepared_joint_plan_is_the_decode_plan_itself(monkeypatch):
    """Affine codes take the model's query as it is: the joint run is the decode plan's own
    run (one Python frame fewer a step), planned to return only the normalized output."""
    made = _fake_plans(monkeypatch)
    query = JointQuery((1, 2, 4, 8), mx.float16, 3, mx.float16, 0.5)
    run = plan_joint(query, "keys", "values")
    assert len(made) == 1 and run is made[0][2]
    kw = made[0][1]
    assert kw["out_only"] and kw["fp16_tokens"] == 3 and kw["scale"] == 0.5


def test_a_prepared_joint_plan_plans_per_dtype_of_the_kernels_query(monkeypatch):
    made = _fake_plans(monkeypatch)
    query = JointQuery((1, 2, 4, 8), mx.float16, 0, mx.float16)
    q = mx.zeros((1, 2, 4, 8), mx.float16)
    run = plan_joint(query, "keys", "values", lambda q: (q.astype(mx.float32), q, None))
    out = run(q, [])
    assert out[0] == "o" and out[1] == mx.float32 and out[3] is q
    assert [d for d, _, _ in made] == [mx.float16, mx.float32]  # planned, then re-planned
    run(q, [])
    assert len(made) == 2  # the float32 plan kept
