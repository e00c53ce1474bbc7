"""Issue 55: at its defaults (no ``every``) nestedkv's cache grows through decode without bound;
like SnapKV it warns once (per policy class and process) when it holds twice its budget."""

from velox_nestedkv import NestedKVCache
from velox_testing.eviction import DecodeGrowthWarning


class TestNestedKVDecodeGrowth(DecodeGrowthWarning):
    cache = NestedKVCache
