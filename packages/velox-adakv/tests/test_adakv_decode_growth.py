"""Issue 55: at its defaults (no ``every``) adakv's cache grows through decode without bound;
like SnapKV it warns once (per policy class and process) when it holds twice its budget."""

from velox_adakv import AdaKVCache
from velox_testing.eviction import DecodeGrowthWarning


class TestAdaKVDecodeGrowth(DecodeGrowthWarning):
    cache = AdaKVCache
