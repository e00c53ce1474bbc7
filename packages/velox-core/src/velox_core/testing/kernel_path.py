"""Checks of a codec's fused-kernel path that the method packages' kernel tests share."""

from __future__ import annotations

import shutil
from collections.abc import Callable
from typing import Any

import mlx.core as mx
import pytest

from ..cache.attention import Segment, partial
from .conformance import assert_partials_close

__all__ = [
    "assert_cpu_declines",
    "assert_kernel_partial",
    "emulated_gpu_fixture",
    "needs_gxx",
]

# marks a test that runs kernels through the C++ emulation (velox_core.kernels.emulate)
needs_gxx = pytest.mark.skipif(
    shutil.which("g++") is None, reason="g++ is not installed: the kernels cannot be emulated"
)


def emulated_gpu_fixture() -> Callable[..., Any]:
    """A fixture ``emulated_gpu``: the kernels run emulated on the CPU for the test (what
    :func:`velox_core.kernels.emulate.emulated_or_skip` returns, built in the test's
    ``tmp_path``), or the test is skipped where they cannot be. A test module binds it once,
    ``emulated_gpu = emulated_gpu_fixture()``, and its tests take ``emulated_gpu``."""

    @pytest.fixture
    def emulated_gpu(monkeypatch: Any, tmp_path: Any) -> Any:
        from ..kernels.emulate import emulated_or_skip

        return emulated_or_skip(monkeypatch, tmp_path)

    return emulated_gpu


def assert_cpu_declines(
    key_codec: Any, keys: Any, value_codec: Any, values: Any, q_shape=(1, 2, 4, 128)
) -> None:
    """On the CPU the codec's fused attention declines: ``attend_partial`` and ``joint_call``
    return None (the caller takes the reference path). Skips the test where the default
    device is a GPU.

    Shapes:
        keys, values: ``Packed`` records of ``(B, H, T, D)`` vectors; q_shape ``(B, H, M, D)``,
        the queries (zeros for ``attend_partial``, fp16 for ``joint_call``).
    """
    if mx.default_device().type == mx.DeviceType.gpu:
        pytest.skip("the default device is a GPU")
    assert key_codec.attend_partial(mx.zeros(q_shape), keys, value_codec, values) is None
    plan = key_codec.joint_call(q_shape, mx.float16, keys, value_codec, values, 0, mx.float16, 0.1)
    assert plan is None


def assert_kernel_partial(
    emulated: Any,
    q: mx.array,
    key_codec: Any,
    keys: Any,
    value_codec: Any,
    values: Any,
    tol: float,
) -> None:
    """The codec's fused partial, run through ``emulated`` (the ``emulated_gpu`` fixture's
    kernels), launches the decode attention and merge kernels only and equals the reference
    partial (:func:`velox_core.cache.attention.partial`) within ``tol``.

    Shapes:
        q ``(B, H_q, M, D)``; keys, values: ``Packed`` records of ``(B, H, T, D)`` vectors.
    """
    emulated.calls.clear()  # launches of the encode kernels that made the records
    got = key_codec.attend_partial(q, keys, value_codec, values)
    assert emulated.names == ["velox_decode_attention", "velox_decode_merge"]
    ref = partial(q, Segment(key_codec, keys, value_codec, values))
    assert_partials_close(got, ref, tol)
