"""What a 4-bit ``uniform`` layer's decode runs in velox-core's Python, counted by tracing it
(the walks in docs/architecture.md): the step between two flushes, and the planning a flush
brings. The kernels are the C++ emulator's (velox-testing), with the backend reported as Metal
or as CUDA; the emulator's own frames, and what they call, are not counted (on a GPU,
``KernelSpec.kernel`` and ``backend``, which the emulator stands in for, are calls into
``kernels/build.py`` and ``kernels/__init__.py``).

A failure here means the path changed: if the change is meant, update the expected files and
counts below and the walks in docs/architecture.md together. The counts are what the path
takes now; the planning may touch at most :data:`PLAN_MOST_FILES` files and the step at most
:data:`STEP_MOST_CALLS` calls in :data:`STEP_MOST_FILES` files (velox issue 49's targets)."""

from __future__ import annotations

import os
import shutil
import sys

import mlx.core as mx
import pytest

import velox_core
import velox_testing
from velox_core import UniformCache, routed
from velox_core.kernels import disk_cache
from velox_core.kernels import encode as ek
from velox_testing import kv_data
from velox_testing.emulate import EmulatedKernels

CORE = os.path.dirname(velox_core.__file__)
TESTING = os.path.dirname(velox_testing.__file__)

needs_gxx = pytest.mark.skipif(
    shutil.which("g++") is None, reason="g++ is not installed: the kernels cannot be emulated"
)

PLAN_MOST_FILES = 6
STEP_MOST_CALLS = 8
STEP_MOST_FILES = 6

# the file of each backend's kernels
KERNELS = {"metal": "kernels/portable.py", "cuda": "kernels/mma.py"}

# the decode step between flushes: (files, Python calls), per backend
STEP_COMMON = {"cache/velox.py", "cache/planned.py", "kernels/decode.py", "kernels/merge.py"}
STEP = {backend: (STEP_COMMON | {KERNELS[backend]}, 8) for backend in KERNELS}

# the planning after a flush: (the files it calls into, helpers included; Python calls): the
# step's and the layout's
PLAN_COMMON = STEP_COMMON | {"kernels/layout.py"}
PLAN = {
    backend: (PLAN_COMMON | {KERNELS[backend]}, calls)
    for backend, calls in (("metal", 91), ("cuda", 49))
}


def trace(fn) -> tuple[list[tuple[str, str]], list[tuple[str, str, str]]]:
    """``(calls, callbacks)`` while ``fn`` runs: ``(file, function)`` of every Python call into
    velox-core's source (files relative to the package), leaving out the emulator's frames
    and their calls; and ``(file, function, caller's file)`` of each call into a file that
    is already on the stack below another file's frame (a file called back after it handed
    off)."""
    calls: list[tuple[str, str]] = []
    callbacks: list[tuple[str, str, str]] = []
    stack: list[str] = []  # velox-core's files on the call stack, innermost last
    inside = [0]

    def profile(frame, event, arg):
        name = frame.f_code.co_filename
        if name.startswith(TESTING):
            inside[0] += {"call": 1, "return": -1}.get(event, 0)
        elif not inside[0] and name.startswith(CORE) and event in ("call", "return"):
            if event == "return":
                stack.pop()
                return
            f = os.path.relpath(name, CORE).replace(os.sep, "/")
            if f in stack and stack[-1] != f:
                callbacks.append((f, frame.f_code.co_name, stack[-1]))
            stack.append(f)
            calls.append((f, frame.f_code.co_name))

    sys.setprofile(profile)
    try:
        mx.eval(fn())
    finally:
        sys.setprofile(None)
    return calls, callbacks


def files(calls: list[tuple[str, str]]) -> set[str]:
    return {f for f, _ in calls}


@needs_gxx
@pytest.mark.parametrize("backend", ["metal", "cuda"])
def test_a_decode_step_and_its_planning_run_through_the_files_documented(
    monkeypatch, tmp_path, backend
):
    # the path of a process whose kernels keep no compiled forms on disk (Metal, or CUDA with
    # VELOX_KERNEL_CACHE=0); another test of this process that built a CUDA kernel leaves
    # ``kept`` set, and a plan made then also opens disk_cache's compile region
    monkeypatch.setattr(disk_cache, "kept", False)
    k, v = kv_data(t=120, dtype=mx.float16)
    cache = UniformCache(bits=4, sinks=2, flush=8)
    cache.fetch_decoded = False  # what make_cache sets for models whose attention is routed
    cache.update_and_fetch(k[:, :, :100], v[:, :, :100])  # encoded on the CPU path
    EmulatedKernels(tmp_path, backend=backend).install(monkeypatch)
    if backend == "cuda":  # the encode kernel's grid is not in the CUDA emulation's subset
        monkeypatch.setattr(ek, "affine_encode", lambda *a, **kw: None)
    q = mx.random.normal((1, 4, 1, 128), key=mx.random.key(1)).astype(mx.float16)
    coded = cache.stored.coded[0][0]
    with routed():
        mx.eval(cache.attend(q, 0.088))  # the first plan, and the kernels built, uncounted
        t = 100
        while True:  # decode steps up to the one that flushes
            before = coded.tokens
            flush, _ = trace(
                lambda t=t: cache.update_and_fetch(k[:, :, t : t + 1], v[:, :, t : t + 1])
            )
            t += 1
            if coded.tokens != before:
                break
            mx.eval(cache.attend(q, 0.088))
        plan, plan_back = trace(lambda: cache.attend(q, 0.088))
        step, step_back = trace(
            lambda: (
                cache.update_and_fetch(k[:, :, t : t + 1], v[:, :, t : t + 1]),
                cache.attend(q, 0.088),
            )
        )
    # the flush asked the codecs for the new segment's kernel sides (its records)
    assert ("cache/planned.py", "refresh") in flush
    assert ("codec/uniform.py", "kernel_keys") in flush
    # the planning: one way down from the cache to the launches, in the files documented
    want, most = PLAN[backend]
    assert files(plan) == want, sorted(files(plan))
    assert len(files(plan)) <= PLAN_MOST_FILES
    assert len(plan) <= most, len(plan)
    assert not plan_back, plan_back
    assert not any(f.startswith("codec/") or f == "cache/attention.py" for f in files(plan))
    # the step starts at the cache and ends in the launches: no planning, no decoding
    want, most = STEP[backend]
    assert files(step) == want, step
    assert len(files(step)) <= STEP_MOST_FILES and len(step) <= most <= STEP_MOST_CALLS, step
    assert not step_back, step_back
    assert step[0] == ("cache/velox.py", "update_and_fetch")
    assert not any(f.startswith("codec/") or f == "cache/attention.py" for f in files(step))
