"""OSCAR's GPU path, checked on a machine without a GPU: velox-core's affine decode kernel
reads the rotated codes (the query rotated before, the partial rotated back after), and the
joint call's merge rotates the coded part back and joins the fp16 sinks and window; the
kernels' Metal instantiation emulated on the CPU (``velox_testing.emulate``: about half a
minute to build)."""

from __future__ import annotations

import mlx.core as mx
import pytest
from _oscar_util import model_artifact

from velox_core import Uniform
from velox_oscar import OscarCache, OscarKeys
from velox_testing import (
    assert_kernel_partial,
    assert_step_like_reference,
    coded_segments,
    emulated_gpu_fixture,
    kv_data,
    needs_gxx,
)

emulated_gpu = emulated_gpu_fixture()


@needs_gxx
def test_the_decode_kernel_reads_the_rotated_codes(emulated_gpu):
    """The fused partial over OSCAR keys and values (over OSCAR keys with plain Uniform
    values, whose partial needs no rotation back, and over per-channel keys with OSCAR values)
    equals the reference partial."""
    k, v = kv_data(t=200)
    c = OscarCache(artifact=model_artifact(), layer=0, window=0, sinks=0)
    c.update_and_fetch(k, v)
    seg = coded_segments(c)[0]
    q = mx.random.normal((1, 2, 4, 128), key=mx.random.key(1)) * 0.1
    assert_kernel_partial(
        emulated_gpu, q, seg.key_codec, seg.keys, seg.value_codec, seg.values, 1e-4
    )
    kc = OscarKeys(artifact=model_artifact(), layer=1)
    kc.check(128, mx.float16)
    u = Uniform(2, 128)
    assert_kernel_partial(emulated_gpu, q, kc, kc.encode(k), u, u.encode(v), 1e-4)
    # keys="channel": KIVI's per-channel key codes (no query rotation) beside OSCAR's values
    c = OscarCache(artifact=model_artifact(), layer=0, window=0, sinks=0, keys="channel")
    c.update_and_fetch(k, v)
    seg = coded_segments(c)[0]
    assert seg.tokens == 128 and seg.key_codec.axis == "channel"
    assert_kernel_partial(
        emulated_gpu, q, seg.key_codec, seg.keys, seg.value_codec, seg.values, 1e-4
    )


@needs_gxx
@pytest.mark.parametrize("keys", ["oscar", "channel"])
def test_a_decode_step_joins_the_exact_tokens_in_one_merge(emulated_gpu, monkeypatch, keys):
    """A cache with sinks and a window: its decode step takes the kernel on the rotated query
    (the model's query for ``keys="channel"``) and the merge that rotates the coded values
    back and scores the exact tokens with the model's query, and matches the reference path."""
    k, v = kv_data(t=160)
    q = mx.random.normal((1, 4, 1, 128), key=mx.random.key(5)).astype(mx.float16)
    spec = {"artifact": model_artifact(), "window": 16, "sinks": 4, "layer": 0, "keys": keys}
    assert_step_like_reference(emulated_gpu, monkeypatch, lambda: OscarCache(**spec), k, v, q)
