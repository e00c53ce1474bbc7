"""Keyformer: the conformance suite, and the method's own checks against a numpy
transcription of the paper's score and selection rule."""

import mlx.core as mx
import numpy as np
import pytest

import velox_testing.eviction as ev
import velox_testing.references as refs
from velox_core import make, make_cache, routed
from velox_keyformer import METHOD, KeyformerCache, KeyformerPolicy
from velox_testing import tiny_model
from velox_testing.eviction import SCALE
from velox_testing.eviction import stored_positions as stored
from velox_testing.refusals import named_refusals


class TestKeyformer(ev.FullBudgetConformance):
    # fp16 tokens (512 B a token and KV head at head dim 128), the body's int32 positions,
    # the float32 accumulated score (520 B) and the 8-byte noise key
    max_memory_ratio = 1.02
    spec = "keyformer:budget=4096"
    bad_settings = (
        *ev.RECENT_BAD,
        *named_refusals(tau_init=[0.0, "hot"], tau_end=[-1.0, float("nan")], steps=0, seed=-1),
        {"kv_cache": 60},  # the authors' percentage of the prompt: velox counts tokens
        {"tau_delta": 0.01},
    )


class TestKeyformerEvicting(ev.Routed, ev.EvictingConformance):
    """A small budget, one eviction per decode step, 4-bit codes (routed: the suite stores
    tokens without attention, and a cut of unseen tokens keeps the newest)."""

    # measured 0.35 (seed 0; H2O at this budget: 0.67): the conformance model's random
    # weights give near-flat logits, where the Gumbel noise (std 1.28) dominates the ranking
    model_logit_cosine = 0.3

    spec = "keyformer:budget=64,bits=4"
    precise_spec = "keyformer:budget=64"


# -- helpers ---------------------------------------------------------------------------------
class Noise:
    """The Gumbel draws of a seeded stream: the seed's first split key, split at every draw
    (one half kept, the other drawn from)."""

    def __init__(self, seed, zero=False):
        self.key, self.zero = mx.random.split(mx.random.key(seed), 1)[0], zero

    def __call__(self, shape):
        ks = mx.random.split(self.key)
        self.key = ks[0]
        g = mx.random.gumbel(shape=shape, key=ks[1])
        return np.zeros(shape) if self.zero else np.array(g, np.float64)


class PaperKeyformer(refs.ScoreReference):
    """The paper's rule in numpy, float64, per KV head: a call stores its tokens (score 0);
    each query adds ``softmax((q k^T * scale + g) / tau)`` over the tokens it sees (GQA: the
    mean over the KV head's query heads); ``tau`` is ``tau_init`` for a prompt call and rises
    by ``(tau_end - tau_init) / steps`` a decode step; then, over budget, the ``recent``
    newest tokens and the top ``budget - recent`` others by score are kept."""

    def __init__(self, k, q, budget, recent, noise, tau=(1.0, 2.0, 512)):
        super().__init__(k, q)
        self.budget, self.recent, self.noise = budget, recent, noise
        self.tau_init, self.tau_end, self.steps = tau
        self.step = 0

    def attend(self, s, e):
        self.step = 0 if e - s > 1 else self.step + 1
        rise = (self.tau_end - self.tau_init) / self.steps
        tau = self.tau_init + min(self.step, self.steps) * rise
        self.store(s, e)
        g = self.noise((1, self.h * self.r, e - s, len(self.pos[0])))[0]
        for h in range(self.h):
            for i in range(s, e):
                seen = self.pos[h] <= i
                noise = g[h * self.r : (h + 1) * self.r, i - s][:, seen]
                x = self.logits(h, i, seen, SCALE) + noise
                y = np.exp((x - x.max(-1, keepdims=True)) / tau)
                self.score[h][seen] += (y / y.sum(-1, keepdims=True)).mean(0)

    def reduce(self, offset):
        self.keep_heavy(self.budget, self.recent, offset)


def run_both(k, v, q, t0, budget, recent, chunk, seed=0, tau=(1.0, 2.0, 512)):
    """velox and the transcription side by side: a prompt of ``t0`` tokens in chunks, then
    one decode step a token; the same tokens and scores at every step."""
    t = k.shape[2]
    c = KeyformerCache(budget=budget, recent=recent, seed=seed, tau_init=tau[0], tau_end=tau[1])
    c.policy.steps = tau[2]
    ref = PaperKeyformer(k, q, budget, recent, Noise(seed), tau)
    calls = [(s, min(s + chunk, t0)) for s in range(0, t0, chunk)]
    for s, e in calls + [(i, i + 1) for i in range(t0, t)]:
        c.update_and_fetch(k[:, :, s:e], v[:, :, s:e])  # the pending cut, then the store
        for h in range(ref.h):
            assert stored(c, h) == ref.kept(h) | set(range(s, e)), (s, h)
        c.attend(q[:, :, s:e], SCALE, mask="causal" if e - s > 1 else None)
        ref.attend(s, e)
        got = np.array(c.policy._scores[0])
        for h in range(ref.h):
            assert np.allclose(got[h], ref.score[h], rtol=1e-4, atol=1e-5), (s, h)
        ref.reduce(e)
    return c, ref


# -- the behaviour -----------------------------------------------------------------------------
def test_saved_state_resumes_the_same_run(tmp_path):
    """Scores, the noise key and the schedule's step are saved: a loaded cache keeps and
    scores exactly as the original does from there on."""
    k, v, q = ev.attention_data(330, seed=8)
    c = KeyformerCache(budget=32, bits=4, group=32, steps=16)
    c.update_and_fetch(k[:, :, :300], v[:, :, :300])
    c.attend(q[:, :, :300], SCALE, mask="causal")
    for i in range(300, 310):
        c.update_and_fetch(k[:, :, i : i + 1], v[:, :, i : i + 1])
        c.attend(q[:, :, i : i + 1], SCALE)
    d = ev.reloaded(c, tmp_path / "c.safetensors")
    assert (
        d.policy.meta()
        == c.policy.meta()
        == {
            "chunk_pending": False,
            "seen": 310,
            "step": 10,
            "draws": 11,
        }
    )
    assert d.policy.nbytes == c.policy.nbytes == 4 * 2 * c.size() + 8
    for i in range(310, 330):
        for x in (c, d):
            x.update_and_fetch(k[:, :, i : i + 1], v[:, :, i : i + 1])
            x.attend(q[:, :, i : i + 1], SCALE)
        assert stored(c, 0) == stored(d, 0) and stored(c, 1) == stored(d, 1)
    assert np.array_equal(np.array(c.policy._scores), np.array(d.policy._scores))


def test_bad_state_is_refused():
    p = KeyformerPolicy(budget=32, recent=8)
    with pytest.raises(ValueError, match=r"float32 \(B, H, S\)"):
        p.set_state({"key": mx.random.key(0), "scores": mx.zeros((2, 100))}, {})
    with pytest.raises(ValueError, match="noise key"):
        p.set_state({"scores": mx.zeros((1, 2, 100)), "key": mx.zeros((3,))}, {})
    k, v, q = ev.attention_data(120, seed=3)
    c = KeyformerCache(budget=32)
    c.update_and_fetch(k[:, :, :100], v[:, :, :100])
    c.attend(q[:, :, :100], SCALE, mask="causal")
    d = c.copy()
    d.policy.set_state({"key": mx.random.key(0), "scores": mx.zeros((1, 2, 90))}, {})
    with pytest.raises(ValueError, match="scores cover 90 tokens"):
        d.update_and_fetch(k[:, :, 100:101], v[:, :, 100:101])
    e = KeyformerCache(budget=40)
    e.update_and_fetch(k[:, :, :100], v[:, :, :100])
    with pytest.raises(ValueError, match="routed"):  # no query seen, not routed
        e.update_and_fetch(k[:, :, 100:101], v[:, :, 100:101])


def test_a_tiny_model_holds_the_budget_in_every_layer():
    """Routed chunked prefill then decode in an mlx-lm model: every layer at budget + 1,
    the layers' noise streams distinct."""
    model = tiny_model("llama")
    prompt = mx.random.randint(0, 512, (1, 256), key=mx.random.key(0))
    caches = make_cache(model, KeyformerCache(budget=64, recent=16))
    with routed(model):
        for s in range(0, 256, 128):
            model(prompt[:, s : s + 128], cache=caches)
        for t in (7, 11, 13):
            model(mx.array([[t]]), cache=caches)
            assert all(c.size() == 65 for c in caches)
    keys = {tuple(np.array(c.policy._key).tolist()) for c in caches}
    assert len(keys) == len(caches) and all(c.offset == 259 for c in caches)


def test_recommended_settings_defaults_and_split():
    assert METHOD.paper == "https://arxiv.org/abs/2403.09054"
    fp16 = make("keyformer", **METHOD.recommended[0])
    assert fp16.policy.config() == {
        "budget": 1024,
        "every": 1,
        "recent": 307,  # the authors' 30% of the cache, rounded down
        "tau_init": 1.0,
        "tau_end": 2.0,
        "steps": 512,
        "seed": 0,
    }
    assert make("keyformer:budget=100,recent=30").policy.recent == 30
    assert make("keyformer:budget=100,recent=0.5").policy.recent == 50
    assert make("keyformer:budget=100,tau_end=4,steps=8").policy.tau_end == 4.0
    assert KeyformerCache.split_refusal({}, True, False) == ""
    with pytest.raises(ValueError, match="budget"):
        KeyformerCache(budget=12, sinks=4, window=8)
    with pytest.raises(ValueError, match="recent"):
        make("keyformer:budget=16,recent=16")
    with pytest.raises(ValueError, match="steps"):
        KeyformerPolicy(budget=16, steps=0)
