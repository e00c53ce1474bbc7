"""velox-core's own method, ``uniform``, passes the shared conformance suite."""

from velox_core import VeloxCache
from velox_testing import CacheConformance


class TestUniform4(CacheConformance):
    spec = "uniform:bits=4,group=64"
    precise_spec = "uniform:bits=8,group=64"

    max_memory_ratio = 0.3  # 4-bit codes + fp16 scale and zero per 64: 0.281 of fp16
    attention_error = 0.3  # per-token groups suffer from the outlier key channels of kv_data
    same_greedy_tokens = 32


class TestUniformExactTrim(CacheConformance):
    """Every token coded on arrival (flush=1, no window): trim is exact, is_trimmable()."""

    spec = "uniform:bits=4,group=64,flush=1"
    precise_spec = "uniform:bits=8,group=64,flush=1"

    max_memory_ratio = 0.3
    attention_error = 0.3


class TestUniformWindowSinksChannel(CacheConformance):
    spec = "uniform:bits=3,key_bits=4,group=32,key_axis=channel,window=16,sinks=4"
    precise_spec = "uniform:bits=8,group=32,key_axis=channel,window=16,sinks=4"

    max_memory_ratio = 0.45
    attention_error = 0.3  # 3-bit values


class TestLossless(CacheConformance):
    """A cache with no codec keeps tokens exactly: attention equals fp16 attention."""

    attention_error = 5e-3  # the fp16 reference rounds its output; velox mixes in fp32
    model_logit_cosine = 0.9999
    same_greedy_tokens = 32
    max_memory_ratio = 1.01  # sinks and window sit beside a 256-token-aligned body

    def make(self):
        return VeloxCache(window=8, sinks=2)
