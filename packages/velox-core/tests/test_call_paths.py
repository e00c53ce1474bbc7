"""What a 4-bit ``uniform`` layer's decode runs in velox-core's Python, counted by tracing it
(the walks in docs/architecture.md): the step between two flushes, and the planning a flush
brings. The kernels are the C++ emulator's (velox-testing), with the backend reported as Metal
or as CUDA; the emulator's own frames, and what they call, are not counted.

A failure here means the path changed: if the change is meant, update the expected files and
counts below and the walks in docs/architecture.md together."""

from __future__ import annotations

import os
import shutil
import sys

import mlx.core as mx
import pytest

import velox_core
import velox_testing
from velox_core import UniformCache, routed
from velox_testing import kv_data
from velox_testing.emulate import EmulatedKernels

CORE = os.path.dirname(velox_core.__file__)
TESTING = os.path.dirname(velox_testing.__file__)

needs_gxx = pytest.mark.skipif(
    shutil.which("g++") is None, reason="g++ is not installed: the kernels cannot be emulated"
)

# the decode step between flushes: (files, most Python calls), per backend
STEP_COMMON = {
    "cache/velox.py",
    "cache/planned.py",
    "kernels/decode.py",
    "kernels/merge.py",
}
STEP = {
    "metal": (STEP_COMMON | {"kernels/portable.py"}, 8),
    "cuda": (STEP_COMMON | {"kernels/mma.py"}, 8),
}

# the planning after a flush: the files it reads, per backend (helpers included)
PLAN_COMMON = {
    "cache/velox.py",
    "cache/planned.py",
    "cache/stored.py",
    "cache/store.py",
    "cache/attention.py",
    "codec/base.py",
    "codec/uniform.py",
    "kernels/__init__.py",
    "kernels/config.py",
    "kernels/records.py",
    "kernels/decode.py",
    "kernels/layout.py",
    "kernels/merge.py",
}
PLAN = {
    "metal": PLAN_COMMON | {"kernels/portable.py"},
    "cuda": PLAN_COMMON | {"kernels/mma.py"},
}


def trace(fn) -> list[tuple[str, str]]:
    """``(file, function)`` of every Python call into velox-core's source while ``fn`` runs
    (files relative to the package), leaving out the emulator's frames and their calls."""
    calls: list[tuple[str, str]] = []
    inside = [0]

    def profile(frame, event, arg):
        name = frame.f_code.co_filename
        if name.startswith(TESTING):
            inside[0] += {"call": 1, "return": -1}.get(event, 0)
        elif event == "call" and not inside[0] and name.startswith(CORE):
            calls.append((os.path.relpath(name, CORE).replace(os.sep, "/"), frame.f_code.co_name))

    sys.setprofile(profile)
    try:
        mx.eval(fn())
    finally:
        sys.setprofile(None)
    return calls


@needs_gxx
@pytest.mark.parametrize("backend", ["metal", "cuda"])
def test_a_decode_step_and_its_planning_run_through_the_files_documented(
    monkeypatch, tmp_path, backend
):
    k, v = kv_data(t=120, dtype=mx.float16)
    cache = UniformCache(bits=4, sinks=2, flush=8)
    cache.fetch_decoded = False  # what make_cache sets for models whose attention is routed
    cache.update_and_fetch(k[:, :, :100], v[:, :, :100])  # encoded on the CPU path
    EmulatedKernels(tmp_path, backend=backend).install(monkeypatch)
    q = mx.random.normal((1, 4, 1, 128), key=mx.random.key(1)).astype(mx.float16)
    with routed():
        mx.eval(cache.attend(q, 0.088))  # the kernels built once, outside the counts
        cache.update_and_fetch(k[:, :, 100:101], v[:, :, 100:101])
        cache._planned.clear()  # as a flush does
        plan = trace(lambda: cache.attend(q, 0.088))
        step = trace(
            lambda: (
                cache.update_and_fetch(k[:, :, 101:102], v[:, :, 101:102]),
                cache.attend(q, 0.088),
            )
        )
    assert {f for f, _ in plan} == PLAN[backend], sorted({f for f, _ in plan})
    files, most = STEP[backend]
    assert {f for f, _ in step} == files, step
    assert len(step) <= most, step
    # the step starts at the cache and ends in the launches: no planning, no decoding
    assert step[0] == ("cache/velox.py", "update_and_fetch")
    assert not any(f.startswith("codec/") or f == "cache/attention.py" for f, _ in step)
