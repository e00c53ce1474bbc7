"""StreamingLLM: the conformance suite, and what is StreamingLLM's own."""

import mlx.core as mx
import numpy as np
import pytest

from velox_core import make_cache, routed
from velox_core.testing import CacheConformance, kv_data, tiny_model
from velox_streamingllm import StreamingLLMCache


class TestStreamingLLM(CacheConformance):
    """With a budget above the test lengths nothing is evicted: exact fp16 attention."""

    max_memory_ratio = 1.01
    attention_error = 5e-3
    model_logit_cosine = 0.9999
    same_greedy_tokens = 32

    def make(self):
        return StreamingLLMCache(budget=4096)


class TestStreamingLLMEvicting(CacheConformance):
    """A small budget with 4-bit codes: evicting, lossy, bounded."""

    max_memory_ratio = 0.1  # measured right after a 512-token chunk: budget + chunk are held
    attention_error = None  # most of the context is evicted: no fp16 reference applies
    model_logit_cosine = 0.5

    def make(self):
        return StreamingLLMCache(budget=64, sinks=4, every=8, bits=4)


def test_keeps_sinks_and_the_most_recent_tokens():
    k, v = kv_data(t=500)
    c = StreamingLLMCache(budget=40, sinks=4, every=1)
    for i in range(500):
        c.update_and_fetch(k[:, :, i : i + 1], v[:, :, i : i + 1])
    assert c.offset == 500 and c.size() <= 41
    kk, _ = c.keys_and_values()
    assert mx.array_equal(kk[:, :, :4], k[:, :, :4])
    pos = np.array(c.body_positions()[0][0])
    assert list(pos) == list(range(500 - len(pos), 500))
    assert mx.array_equal(kk[:, :, 4:], k[:, :, mx.array(pos)])


def test_bounded_prefill_and_model_positions():
    """Inside a model: eviction during chunked prefill, absolute offsets, fp16-equal while
    nothing has been evicted."""
    model = tiny_model("llama")
    prompt = mx.random.randint(0, 512, (1, 300), key=mx.random.key(0))
    caches = make_cache(model, StreamingLLMCache(budget=96, sinks=4, every=16))
    with routed(model):
        sizes = []
        for s in range(0, 300, 64):
            model(prompt[:, s : s + 64], cache=caches)
            sizes.append(max(c.size() for c in caches))
        sizes = [c.size() for c in caches]
        out = model(prompt[:, -1:], cache=caches)
    assert all(c.offset == 301 for c in caches)
    assert max(sizes) <= 96 + 64
    assert all(c.size() <= 97 for c in caches)
    assert out.shape == (1, 1, 512)


@pytest.mark.parametrize(
    "bad", [{"budget": 4, "sinks": 4}, {"budget": 0}, {"every": 0}, {"bits": 1}, {"key_bits": 4}]
)
def test_bad_settings(bad):
    with pytest.raises((ValueError, TypeError)):
        StreamingLLMCache(**bad)
