"""Checks of a codec's fused-kernel path that the method packages' kernel tests share."""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import pytest

__all__ = ["assert_cpu_declines"]


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
