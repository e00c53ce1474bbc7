"""A segment's kernel sides (``velox_core.kernels.joint``) planned in one place
(``velox_core.kernels.decode.plan_segment``, ``segment_partial``)."""

from __future__ import annotations

import logging

import mlx.core as mx
import numpy as np

import velox_core.kernels as vk
from velox_core import Identity, Uniform
from velox_core.cache import attention as att
from velox_core.kernels import decode as dk
from velox_core.kernels.decode import plan_segment, segment_partial
from velox_core.kernels.joint import JointQuery, KernelSide


def _fake_plans(monkeypatch):
    made = []

    def fake_plan(q_shape, q_dtype, keys, values, **kw):
        def run(q, fp16=None, merge_q=None, q_sketch=None):
            return ("o", q_dtype, q, merge_q, q_sketch)

        made.append((q_dtype, kw, run))
        return run

    monkeypatch.setattr(dk, "plan_decode", fake_plan)
    return made


def test_sides_the_kernel_reads_as_they_are_plan_to_the_decode_plan_itself(monkeypatch):
    """Affine codes take the model's query as it is: the joint run is the decode plan's own
    run (one Python frame fewer a step), planned to return only the normalized output."""
    made = _fake_plans(monkeypatch)
    query = JointQuery((1, 2, 4, 8), mx.float16, 3, mx.float16, 0.5)
    run = plan_segment(query, KernelSide("keys"), KernelSide("values"))
    assert len(made) == 1 and run is made[0][2]
    kw = made[0][1]
    assert kw["out_only"] and kw["fp16_tokens"] == 3 and kw["scale"] == 0.5
    assert not kw["merge_q"] and kw["rot"] is None and not kw["q_sketch"]


def test_a_key_query_plans_per_dtype_and_merges_with_the_models_query(monkeypatch):
    made = _fake_plans(monkeypatch)
    query = JointQuery((1, 2, 4, 8), mx.float16, 0, mx.float16)
    q = mx.zeros((1, 2, 4, 8), mx.float16)
    keys = KernelSide("keys", query=lambda q: q.astype(mx.float32))
    run = plan_segment(query, keys, KernelSide("values"))
    out = run(q, [])
    assert out[0] == "o" and out[1] == mx.float32 and out[3] is q and out[4] is None
    assert [d for d, _, _ in made] == [mx.float16, mx.float32]  # planned, then re-planned
    assert made[0][1]["merge_q"]
    run(q, [])
    assert len(made) == 2  # the float32 plan kept


def test_query_dtype_and_input_and_values_coded_in_another_domain(monkeypatch):
    """``query_dtype`` is planned first; the query-side input is made from the kernel's
    query; values with ``back`` go to the merge as its ``rot`` beside the model's query."""
    made = _fake_plans(monkeypatch)
    query = JointQuery((1, 2, 4, 8), mx.float16, 2, mx.float16, 0.5)
    keys = KernelSide(
        "keys", query=lambda q: q.astype(mx.float32) * 2, query_dtype=mx.float32,
        query_input=lambda kq: kq + 1,
    )  # fmt: skip
    back = mx.eye(8)
    run = plan_segment(query, keys, KernelSide("values", back=back))
    assert [d for d, _, _ in made] == [mx.float32]
    kw = made[0][1]
    assert kw["merge_q"] and kw["rot"] is back and kw["q_sketch"]
    q = mx.ones((1, 2, 4, 8), mx.float16)
    _, dtype, kq, mq, qs = run(q, [])
    assert dtype == mx.float32 and mq is q
    assert mx.array_equal(kq, q * 2).item() and mx.array_equal(qs, q * 2 + 1).item()


def test_segment_partial_maps_coded_values_back(monkeypatch):
    """The partial's output is ``o @ back``: values coded in another domain return in the
    model's (what TurboQuant's rotated values and VecInfer's transformed ones need)."""
    o = mx.random.normal((1, 2, 4, 8), key=mx.random.key(0))
    m, l = mx.zeros((1, 2, 4, 1)), mx.ones((1, 2, 4, 1))
    seen = {}

    def fake_decode(q, keys, values, q_sketch=None):
        seen.update(q=q, q_sketch=q_sketch)
        return o, m, l

    monkeypatch.setattr(dk, "decode_attention", fake_decode)
    back = mx.random.normal((8, 8), key=mx.random.key(1))
    keys = KernelSide("keys", query=lambda q: -q, query_input=lambda kq: kq * 3)
    q = mx.ones((1, 2, 4, 8))
    got, gm, gl = segment_partial(q, keys, KernelSide("values", back=back))
    np.testing.assert_allclose(np.array(got), np.array(o @ back), rtol=1e-6)
    assert gm is m and gl is l
    assert mx.array_equal(seen["q"], -q).item() and mx.array_equal(seen["q_sketch"], -3 * q)


def test_the_one_decision_logs_a_codec_pair_once(monkeypatch, caplog):
    """``kernel_sides`` decides alone whether a segment reaches the kernels; a pair that
    gives none is logged once (INFO, ``velox_core.kernels``), naming the side that declined."""
    monkeypatch.setattr(att, "_DECLINED", set())
    k = mx.random.normal((1, 2, 8, 64), key=mx.random.key(2))
    tok, ident = Uniform(4), Identity()
    kp, vp, vi = tok.encode(k), tok.encode(k), ident.encode(k)  # on the CPU path
    monkeypatch.setattr(vk, "backend", lambda: "cuda")
    with caplog.at_level(logging.INFO, logger="velox_core.kernels"):
        for _ in range(3):
            assert att.kernel_sides(tok, kp, ident, vi, (1, 2, 4, 64)) is None
    msgs = [r.getMessage() for r in caplog.records]
    assert msgs == ["no decode kernel for uniform keys with fp16 values (their values): "
                    "reference path"]  # fmt: skip
    sides = att.kernel_sides(tok, kp, tok, vp, (1, 2, 4, 64))
    assert sides is not None and sides[0].record.kind == sides[1].record.kind == 0
    monkeypatch.setattr(vk, "backend", lambda: "cpu")
    assert att.kernel_sides(tok, kp, tok, vp, (1, 2, 4, 64)) is None
