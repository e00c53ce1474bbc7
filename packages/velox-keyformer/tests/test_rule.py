"""Keyformer's rule: velox against the numpy transcription, the schedule, the noise."""

import numpy as np
import pytest
from test_keyformer import SCALE, Noise, PaperKeyformer, run_both

import velox_testing.eviction as ev
from velox_keyformer import KeyformerCache, temperature
from velox_testing.eviction import stored_positions as stored


@pytest.mark.parametrize("r", [1, 3])
def test_prompt_then_decode_keeps_what_the_papers_rule_keeps(r):
    """The prompt's Gumbel scores reduce it to budget, then each decode step adds its
    query's scores at the step's temperature and drops one token: MHA and GQA."""
    k, v, q = ev.attention_data(260, r=r, seed=r)
    c, ref = run_both(k, v, q, t0=200, budget=48, recent=14, chunk=200)
    assert ref.kept(0) != ref.kept(1)  # each KV head its own key tokens
    assert c.size() == 49 and abs(c.policy.tau - (1.0 + 60 / 512)) < 1e-12


def test_chunked_prefill_and_a_short_schedule():
    """Chunks cut with the scores so far; a schedule of 20 steps reaches tau_end and stays."""
    k, v, q = ev.attention_data(330, seed=7)
    c, _ = run_both(k, v, q, t0=300, budget=40, recent=8, chunk=64, tau=(0.5, 3.0, 20))
    assert c.policy.tau == 3.0


def test_the_noise_and_the_temperature_change_the_choice():
    """Without the noise (the plain accumulated attention, H2O's score) or at a fixed
    temperature, the transcription keeps other tokens: both parts of the score matter."""
    k, v, q = ev.attention_data(300, seed=4)
    _, ref = run_both(k, v, q, t0=200, budget=40, recent=10, chunk=200)
    for noise, tau in ((Noise(0, zero=True), (1.0, 2.0, 512)), (Noise(0), (1.0, 1.0, 512))):
        other = PaperKeyformer(k, q, 40, 10, noise, tau)
        for s, e in [(0, 200)] + [(i, i + 1) for i in range(200, 300)]:
            other.attend(s, e)
            other.reduce(e)
        assert any(other.kept(h) != ref.kept(h) for h in range(2))


def test_temperature_schedule():
    assert temperature(0, 1.0, 2.0, 100) == 1.0
    assert temperature(25, 1.0, 2.0, 100) == 1.25
    assert temperature(100, 1.0, 2.0, 100) == temperature(500, 1.0, 2.0, 100) == 2.0
    assert temperature(5, 2.0, 1.0, 10) == 1.5  # a falling schedule is allowed
    k, v, q = ev.attention_data(110, seed=2)
    c = KeyformerCache(budget=32, steps=4)
    c.update_and_fetch(k[:, :, :100], v[:, :, :100])
    c.attend(q[:, :, :100], SCALE, mask="causal")
    taus = [c.policy.tau]
    for i in range(100, 106):
        c.update_and_fetch(k[:, :, i : i + 1], v[:, :, i : i + 1])
        c.attend(q[:, :, i : i + 1], SCALE)
        taus.append(c.policy.tau)
    assert taus == [1.0, 1.25, 1.5, 1.75, 2.0, 2.0, 2.0]
    c.update_and_fetch(k[:, :, 106:110], v[:, :, 106:110])  # a new prompt chunk: restart
    c.attend(q[:, :, 106:110], SCALE, mask="causal")
    assert c.policy.tau == 1.0


def _kept_after(seed, layer=None):
    k, v, q = ev.attention_data(240, seed=5)
    c = KeyformerCache(budget=40, seed=seed)
    if layer is not None:
        c.policy.bind(None, layer)
    c.update_and_fetch(k[:, :, :200], v[:, :, :200])
    c.attend(q[:, :, :200], SCALE, mask="causal")
    for i in range(200, 240):
        c.update_and_fetch(k[:, :, i : i + 1], v[:, :, i : i + 1])
        c.attend(q[:, :, i : i + 1], SCALE)
    return [stored(c, h) for h in range(2)], np.array(c.policy._scores)


def test_a_seed_makes_the_run_reproducible():
    a, sa = _kept_after(0)
    b, sb = _kept_after(0)
    assert a == b and np.array_equal(sa, sb)
    _, sc = _kept_after(1)
    assert not np.allclose(sa, sc)  # another seed, other noise
    _, sd = _kept_after(0, layer=3)
    assert not np.allclose(sa, sd)  # each layer its own stream


def test_the_budget_holds_during_decode_and_the_recent_window_stays():
    k, v, q = ev.attention_data(200, seed=8)
    c = KeyformerCache(budget=32, recent=12)
    c.update_and_fetch(k[:, :, :100], v[:, :, :100])
    c.attend(q[:, :, :100], SCALE, mask="causal")
    for i in range(100, 200):
        c.update_and_fetch(k[:, :, i : i + 1], v[:, :, i : i + 1])
        assert c.size() == 33
        for h in range(2):
            assert set(range(i - 12, i + 1)) <= stored(c, h), (i, h)
        c.attend(q[:, :, i : i + 1], SCALE)
    assert c.policy._scores.shape == (1, 2, 33)
