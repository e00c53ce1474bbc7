"""StreamingLLM: the conformance suite, and what is StreamingLLM's own."""

import mlx.core as mx
import numpy as np

import velox_testing.eviction as ev
from velox_core import make_cache, routed
from velox_streamingllm import StreamingLLMCache
from velox_testing import kv_data, tiny_model


class TestStreamingLLM(ev.FullBudgetConformance):
    def make(self):
        return StreamingLLMCache(budget=4096)


class TestStreamingLLMEvicting(ev.EvictingConformance):
    """4-bit codes of the kept tokens."""

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
    pos = np.array(c.policy_view.body_positions()[0][0])
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
