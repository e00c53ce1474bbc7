"""CaM's merge maths against the rule applied one evicted token at a time (numpy, float64)."""

import mlx.core as mx
import numpy as np
import pytest

from velox_cam import merge_probabilities, merged_values


def one_at_a_time(values, mask, m):
    """Evict the oldest token ``n`` times: its value (with what it received) times its mask,
    divided by ``m``, added to each of the ``m`` tokens after it."""
    v = np.array(values, np.float64)
    n = mask.shape[-1]
    for i in range(n):
        v[:, :, i + 1 : i + 1 + m] += (mask[:, :, i, None] * v[:, :, i] / m)[:, :, None]
    return v[:, :, n : n + m]


@pytest.mark.parametrize(
    ("n", "m"),
    [(0, 4), (1, 1), (1, 7), (1, 16), (3, 1), (5, 4), (16, 16), (37, 8), (129, 16), (257, 7)],
)
def test_merged_values_equal_the_evictions_one_at_a_time(n, m):
    rng = np.random.default_rng(n * 31 + m)
    v = rng.normal(size=(2, 3, n + m, 5)).astype(np.float32)
    mask = (rng.random((2, 3, n)) < 0.7).astype(np.float32)
    got = np.array(merged_values(mx.array(v), mx.array(mask), m))
    want = one_at_a_time(v, mask, m)
    assert got.shape == (2, 3, m, 5)
    assert np.allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


@pytest.mark.parametrize("n", [1, 5])
def test_one_mask_row_serves_every_batch_row(n):
    """The policy draws one mask a KV head for the whole batch: ``(1, H, n)``."""
    rng = np.random.default_rng(n)
    v = rng.normal(size=(2, 3, n + 4, 5)).astype(np.float32)
    mask = (rng.random((1, 3, n)) < 0.5).astype(np.float32)
    got = np.array(merged_values(mx.array(v), mx.array(mask), 4))
    want = one_at_a_time(v, np.broadcast_to(mask, (2, 3, n)), 4)
    assert np.allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


def test_every_value_merged_reaches_the_kept_tokens_whole():
    """With every mask 1 nothing is lost: the kept tokens' values gain the sum of every
    evicted value (each one's mass passes on, split into m parts, until it is kept)."""
    rng = np.random.default_rng(0)
    n, m = 50, 8
    v = rng.normal(size=(1, 1, n + m, 3)).astype(np.float32)
    got = np.array(merged_values(mx.array(v), mx.ones((1, 1, n)), m))
    assert np.allclose(got.sum(axis=2), v.sum(axis=2), rtol=1e-4, atol=1e-4)
    # with every mask 0 the kept values are as they were
    same = np.array(merged_values(mx.array(v), mx.zeros((1, 1, n)), m))
    assert np.array_equal(same, v[:, :, n:])


def test_merge_probabilities():
    """p_i = A_i / mean of the m scores after it, clipped to [0, 1]; a zero mean gives 1
    for a positive score and 0 for a zero one (the authors' inf and NaN)."""
    s = np.array([[[2.0, 1.0, 3.0, 4.0, 0.0, 0.0, 0.0, 5.0, 0.0]]], np.float32)
    p = np.array(merge_probabilities(mx.array(s), 6, 2))[0, 0]
    # 2/2; 1/3.5; 3/2 clipped; 4/0 (inf) clipped; 0/0 (NaN) as 0; 0/2.5
    assert np.allclose(p, [1.0, 1 / 3.5, 1.0, 1.0, 0.0, 0.0])
    zero = np.array(merge_probabilities(mx.zeros((1, 2, 5)), 3, 2))
    assert np.array_equal(zero, np.zeros((1, 2, 3)))
    lone = np.array(merge_probabilities(mx.array([[[0.5, 0.0, 0.0]]]), 1, 2))
    assert np.array_equal(lone, [[[1.0]]])
    with pytest.raises(ValueError, match="cannot evict"):
        merge_probabilities(mx.ones((1, 1, 5)), 3, 4)
    with pytest.raises(ValueError, match="merge=0"):
        merged_values(mx.ones((1, 1, 5, 2)), mx.ones((1, 1, 5)), 0)
