"""The shared conformance suite: the 4-bit default, 1-bit sign codes with an fp16 window and
sinks, 3-bit codes against the zero centroid, and a block-Hadamard head dim."""

from velox_testing import CacheConformance


class TestRaBitQ4(CacheConformance):
    """The default: 4-bit keys and values, a centroid per 128 tokens."""

    spec = "rabitq:bits=4"
    precise_spec = "rabitq:bits=8"

    max_memory_ratio = 0.29  # measured 0.2778: 70 B keys + 72 B values per 512 B of fp16
    attention_error = 0.22  # measured 0.14 (attention test) and 0.17 (trim test); uniform 0.23
    same_greedy_tokens = 32

    bad_settings = (
        {"bits": 1},  # values need 2 bits at least
        {"bits": 2.5},
        {"key_bits": 0},
        {"value_bits": 1},
        {"centroid": -1},
        {"centroid": 1.5},
        {"rounds": 0},
        {"rounds": 9},
    )


class TestRaBitQ1Window(CacheConformance):
    """RaBitQ's own 1-bit sign codes, 4-bit values, an fp16 window of 64 and 4 sinks."""

    spec = "rabitq:key_bits=1,value_bits=4,centroid=32,window=64,sinks=4"
    precise_spec = "rabitq:key_bits=1,value_bits=8,centroid=32,window=64,sinks=4"

    max_memory_ratio = 0.25  # measured 0.2427 (fp16 window and sinks included)
    # measured 1.57 and 0.60: unbiased 1-bit scores have a large variance, which the very
    # peaked logits of kv_data amplify (QJL's 1-bit sketch, m = 128: 0.64 and 0.93)
    attention_error = 1.8


class TestRaBitQ3ZeroCentroid(CacheConformance):
    """3-bit extended codes against the zero centroid: every token coded alone."""

    spec = "rabitq:bits=3,centroid=0"
    precise_spec = "rabitq:bits=6,centroid=0"

    max_memory_ratio = 0.22  # measured 0.2114
    attention_error = 0.45  # measured 0.34 and 0.36
    same_greedy_tokens = 32


class TestRaBitQ2Dim96(CacheConformance):
    """Head dim 96: block-Hadamard rounds (blocks of 32 after a permutation), 2-bit codes."""

    spec = "rabitq:bits=2,group=32,centroid=64"
    precise_spec = "rabitq:bits=6,group=32,centroid=64"

    head_dim = 96
    max_memory_ratio = 0.185  # measured 0.1759
    attention_error = 1.25  # measured 1.05 and 0.54 (uniform 2-bit keys and values: 1.87, 1.10)
    same_greedy_tokens = 32
