"""velox's CUDA kernels compiled in parallel and ahead of use (``kernels/disk_cache.py``), on a
machine without NVRTC: ``compile_cuda`` is replaced by a fake that sleeps and records.

* ``compile_ahead``: variants compile at once in the pool, each once; a use waits for a
  compile in flight; the files are written; a failure is reported once and turns the disk
  cache off.
* The regions of ``CachedKernel`` calls: ``compiled_together`` (the block's end waits),
  ``compiling_ahead`` (nothing waits; the variant's first real call does), ``at_once``.
* A cache on a (faked) CUDA device: its first prefill chunk starts the compiles of the
  encode and the probe at its write, and of the decode kernel and the merge at its attention;
  its first decode step then compiles nothing.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import mlx.core as mx
import pytest

import velox_core.kernels as vk
from velox_core import UniformCache
from velox_core.cache import planned
from velox_core.kernels import disk_cache
from velox_core.kernels import mma as kmma
from velox_core.kernels.build import KernelSpec
from velox_core.kernels.config import configured
from velox_testing import kv_data

DELAY = 0.4  # seconds a fake compile takes


class FakeNVRTC:
    """``compile_cuda``'s stand-in: records the kernels, sleeps ``delay`` (or until ``gate`` is
    set), counts the compiles running at once, and fails with ``fail`` if given."""

    def __init__(self, delay: float = 0.0, fail: str | None = None) -> None:
        self.delay, self.fail = delay, fail
        self.gate: threading.Event | None = None
        self.calls: list[str] = []
        self.running = self.most = 0
        self.lock = threading.Lock()

    def __call__(self, source: str, kernel: str, file_name: str) -> tuple[bytes, str]:
        with self.lock:
            self.calls.append(kernel)
            self.running += 1
            self.most = max(self.most, self.running)
        if self.gate is not None:
            self.gate.wait(10)
        time.sleep(self.delay)
        with self.lock:
            self.running -= 1
        if self.fail:
            raise RuntimeError(self.fail)
        return b"cubin of " + kernel.encode(), "_Z" + kernel


@pytest.fixture
def nvrtc(tmp_path, monkeypatch):
    monkeypatch.setenv("MLX_PTX_CACHE_DIR", str(tmp_path / "ptx"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    monkeypatch.setattr(disk_cache.CachedKernel, "failed", False)
    disk_cache.ptx_cache_dir.cache_clear()
    monkeypatch.setattr(disk_cache, "kept", disk_cache.kept)  # as it was, after the test
    monkeypatch.setattr(vk, "backend", lambda: "cuda")  # compiled ahead on CUDA only
    fake = FakeNVRTC()
    monkeypatch.setattr(disk_cache, "compile_cuda", fake)
    yield fake
    settle()  # no compile of this test runs on into the next one's fake
    disk_cache.ptx_cache_dir.cache_clear()


def settle(seconds: float = 30.0) -> None:
    """Wait for every compile in flight in this process (a failed one included)."""
    with disk_cache._lock:
        futures = list(disk_cache._inflight.values())
    for f in futures:
        try:
            f.result(seconds)
        except Exception:
            pass


def until(done, seconds: float = 10.0) -> bool:
    """Whether ``done()`` holds within ``seconds`` (a compile thread's steps)."""
    end = time.perf_counter() + seconds
    while not done() and time.perf_counter() < end:
        time.sleep(0.01)
    return done()


def items(n: int) -> list[tuple[str, str]]:
    return [(f"// source {i}\n", f"custom_kernel_velox_test_{i}") for i in range(n)]


def path_of(item: tuple[str, str]) -> Path:
    source, name = item
    return disk_cache.ptx_path(disk_cache.module_name(name, source))


def test_variants_compile_at_once_each_once_into_whole_files(nvrtc):
    nvrtc.delay = DELAY
    t0 = time.perf_counter()
    futures = disk_cache.compile_ahead(items(4))
    assert time.perf_counter() - t0 < DELAY / 2  # started, not waited for
    paths = [f.result() for f in futures]
    took = time.perf_counter() - t0
    assert nvrtc.most == 4 and took < 2.5 * DELAY, (nvrtc.most, took)  # not 4 x DELAY
    assert paths == [path_of(i) for i in items(4)]
    for (_, name), path in zip(items(4), paths):
        assert path.read_bytes() == f"cubin of mlx::core::cu::{name}".encode()
        assert path.with_suffix(".txt").read_text() == (
            f"mlx::core::cu::{name}\t_Zmlx::core::cu::{name}\n"
        )
    assert not list(path.parent.glob(".velox-*"))  # no partial file left
    again = disk_cache.compile_ahead(items(4))  # on disk: done at once, nothing compiled
    assert all(f.done() for f in again) and len(nvrtc.calls) == 4
    assert sorted(nvrtc.calls) == sorted(f"mlx::core::cu::{n}" for _, n in items(4))


def test_a_use_waits_for_the_compile_in_flight_and_compiles_nothing(nvrtc):
    nvrtc.gate = threading.Event()
    (item,) = items(1)
    (first,) = disk_cache.compile_ahead([item])
    (second,) = disk_cache.compile_ahead([item])
    assert second is first  # the same compile, in flight
    launched = []

    def mlx_kernel(**kw):  # MLX would look for the file when it launches
        launched.append(path_of(item).exists())
        return ["out"]

    k = disk_cache.CachedKernel(mlx_kernel, lambda i, o, t: item)
    caller = threading.Thread(target=lambda: k(inputs=[], output_dtypes=[mx.float16]))
    caller.start()
    time.sleep(DELAY / 2)
    assert caller.is_alive() and not launched  # waiting for the compile
    nvrtc.gate.set()
    caller.join(10)
    assert launched == [True] and len(nvrtc.calls) == 1
    assert disk_cache.ensure_compiled(*item) == path_of(item) and len(nvrtc.calls) == 1


def _cached(launches: list) -> disk_cache.CachedKernel:
    """A wrapper whose MLX kernel records its launches, its variants named by ``N``."""
    return disk_cache.CachedKernel(
        lambda **kw: launches.append(kw) or ["out"], lambda i, o, t: (f"// {t}\n", f"k{t[0][1]}")
    )


def test_calls_in_a_together_block_compile_at_once_and_the_block_waits(nvrtc):
    nvrtc.delay = DELAY
    launches = []
    k = _cached(launches)
    t0 = time.perf_counter()
    with disk_cache.compiled_together():
        for n in (1, 2, 3, 2):
            k(inputs=[], output_dtypes=[mx.float16], template=[("N", n)])
        assert len(launches) == 4 and time.perf_counter() - t0 < DELAY / 2  # calls go on
    took = time.perf_counter() - t0
    assert DELAY <= took < 2 * DELAY and nvrtc.most == 3, (took, nvrtc.most)
    assert len(nvrtc.calls) == 3  # the repeated template once
    assert all(path_of((f"// {[('N', n)]}\n", f"k{n}")).exists() for n in (1, 2, 3))


def test_with_compile_ahead_off_each_call_in_a_together_block_waits_for_its_own(nvrtc):
    nvrtc.delay = DELAY
    launches = []
    k = _cached(launches)
    with configured(compile_ahead=False):
        assert not disk_cache.compiles_ahead()
        t0 = time.perf_counter()
        with disk_cache.compiled_together():
            for n in (1, 2):
                k(inputs=[], output_dtypes=[mx.float16], template=[("N", n)])
                assert path_of((f"// {[('N', n)]}\n", f"k{n}")).exists()  # compiled first
        took = time.perf_counter() - t0
    assert took >= 2 * DELAY and nvrtc.most == 1, (took, nvrtc.most)
    assert len(launches) == 2 and disk_cache.compiles_ahead()


def test_calls_compiled_ahead_wait_for_nothing_and_their_first_real_call_waits(nvrtc):
    nvrtc.gate = threading.Event()
    launches = []
    k = _cached(launches)
    with disk_cache.compiling_ahead():
        for _ in range(3):  # started once
            k(inputs=[mx.zeros((2,))], output_dtypes=[mx.float16], template=[("N", 7)])
    assert len(launches) == 3 and not k.seen
    assert until(lambda: len(nvrtc.calls) == 1)
    path = path_of(("// [('N', 7)]\n", "k7"))
    done = []
    caller = threading.Thread(
        target=lambda: done.append(
            k(inputs=[], output_dtypes=[mx.float16], template=[("N", 7)]) and path.exists()
        )
    )
    caller.start()
    time.sleep(DELAY / 2)
    assert not done  # the real call waits for the compile started ahead
    nvrtc.gate.set()
    caller.join(10)
    assert done == [True] and len(nvrtc.calls) == 1
    with disk_cache.compiling_ahead():  # a variant that went through the wrapper: not again
        k(inputs=[], output_dtypes=[mx.float16], template=[("N", 7)])
    assert len(nvrtc.calls) == 1


def test_at_once_waits_inside_a_block_compiling_ahead(nvrtc):
    nvrtc.delay = DELAY
    k = _cached([])
    with disk_cache.compiling_ahead():
        with disk_cache.at_once():
            t0 = time.perf_counter()
            k(inputs=[], output_dtypes=[mx.float16], template=[("N", 1)])
            assert time.perf_counter() - t0 >= DELAY
        k(inputs=[], output_dtypes=[mx.float16], template=[("N", 2)])
    assert path_of(("// [('N', 1)]\n", "k1")).exists()
    assert not path_of(("// [('N', 2)]\n", "k2")).exists()  # still compiling


def test_a_failed_compile_is_reported_once_and_mlx_compiles_the_rest(nvrtc, capsys):
    nvrtc.fail, nvrtc.delay = "NVRTC failed on k", DELAY / 4
    launches = []
    k = _cached(launches)
    with disk_cache.compiled_together():  # two compiles in flight, both fail
        k(inputs=[], output_dtypes=[mx.float16], template=[("N", 9)])
        k(inputs=[], output_dtypes=[mx.float16], template=[("N", 10)])
    assert until(lambda: disk_cache.CachedKernel.failed)  # (reported by a compile's thread)
    for f in disk_cache.compile_ahead(items(2)):  # a direct use gets the error itself
        with pytest.raises(RuntimeError, match="NVRTC failed"):
            f.result()
    k(inputs=[], output_dtypes=[mx.float16], template=[("N", 11)])  # off: straight to MLX
    with disk_cache.compiling_ahead():
        k(inputs=[], output_dtypes=[mx.float16], template=[("N", 12)])
    err = capsys.readouterr().err
    assert err.count("velox: kernels are not kept on disk (NVRTC failed on k)") == 1, err
    assert len(launches) == 4 and len(nvrtc.calls) == 4  # 9, 10 and the direct two
    assert not disk_cache.compiles_ahead()
    assert not any(path_of(i).exists() for i in items(2))


# -- a cache's first prefill chunk and first decode step on a (faked) CUDA device ----------------


class FakeMLXKernel:
    """``mx.fast.cuda_kernel``'s stand-in: zeros of the output shapes, lazily."""

    def __call__(self, *, output_shapes, output_dtypes, init_value=None, **kw):
        return [mx.zeros(s, d) for s, d in zip(output_shapes, output_dtypes)]


@pytest.fixture
def cuda(nvrtc, monkeypatch):
    """A CUDA device as far as velox can tell: the backend, every kernel a CachedKernel over
    a fake MLX kernel, and a device whose subnormal probe has not run."""
    built: dict[str, disk_cache.CachedKernel] = {}

    def kernel(spec: KernelSpec):
        if spec.name not in built:
            built[spec.name] = disk_cache.CachedKernel(FakeMLXKernel(), spec.mlx_source)
        return built[spec.name]

    monkeypatch.setattr(vk, "backend", lambda: "cuda")
    monkeypatch.setattr(KernelSpec, "kernel", kernel)
    monkeypatch.setattr(disk_cache, "kept", True)
    monkeypatch.setattr(kmma, "_cuda_ordinal", lambda: 0)
    monkeypatch.setattr(kmma, "_SUBNORMALS", {})
    monkeypatch.setattr(planned, "_PLANNED_AHEAD", set())
    return nvrtc


SPECS = (
    "velox_encode_affine",
    "velox_probe_subnormal_mma",
    "velox_decode_attention_mma",
    "velox_decode_attention_mma_parts",
    "velox_decode_merge_fp16",
)


def kernel_names(calls: list[str]) -> list[str]:
    """The velox kernel of each compile (``mlx::core::cu::custom_kernel_<spec name>...``)."""
    out = []
    for c in calls:
        name = c.removeprefix("mlx::core::cu::custom_kernel_")
        out.append(max((s for s in SPECS if name.startswith(s)), key=len, default=name))
    return sorted(out)


@pytest.mark.parametrize(
    "params, decode",
    [
        ({}, ["velox_decode_attention_mma_parts", "velox_decode_merge_fp16"]),
        (
            {"sinks": 4, "window": 16},
            ["velox_decode_attention_mma_parts", "velox_decode_merge_fp16"],
        ),
        ({"flush": 1}, ["velox_decode_attention_mma"]),  # no fp16 token: the kernel merges
    ],
)
def test_the_first_decode_step_finds_its_kernels_compiled_during_the_prefill(cuda, params, decode):
    k, v = kv_data(t=101, dtype=mx.float16)
    cache = UniformCache(bits=4, **params)
    q = mx.zeros((1, 8, 100, 128), mx.float16)  # 4 query heads a KV head
    cache.update_and_fetch(k[:, :, :100], v[:, :, :100])
    # the write: the encode, and beside it the probe the decode plan runs first
    assert until(lambda: len(cuda.calls) == 2)
    assert kernel_names(cuda.calls) == ["velox_encode_affine", "velox_probe_subnormal_mma"]
    mx.eval(cache.attend(q, 0.088))
    assert until(lambda: len(cuda.calls) == 2 + len(decode))  # started in the background
    ahead = sorted(cuda.calls)
    assert kernel_names(ahead) == sorted(
        ["velox_encode_affine", "velox_probe_subnormal_mma", *decode]
    )
    cache.update_and_fetch(k[:, :, 100:], v[:, :, 100:])
    mx.eval(cache.attend(q[:, :, :1], 0.088))
    assert sorted(cuda.calls) == ahead  # the step's variants were all on disk


@pytest.mark.parametrize("off", [{"disk_cache": False}, {"compile_ahead": False}])
def test_nothing_is_compiled_ahead_with_either_switch_off_or_on_the_cpu(cuda, monkeypatch, off):
    k, v = kv_data(t=100, dtype=mx.float16)
    q = mx.zeros((1, 8, 100, 128), mx.float16)
    with configured(**off):
        cache = UniformCache(bits=4)
        cache.update_and_fetch(k, v)
        mx.eval(cache.attend(q, 0.088))
    assert kernel_names(cuda.calls) == ["velox_encode_affine"]  # its own call only
    monkeypatch.setattr(vk, "backend", lambda: "cpu")
    assert not disk_cache.compiles_ahead()
    cache = UniformCache(bits=4)
    cache.update_and_fetch(k, v)
    mx.eval(cache.attend(q, 0.088))
    assert len(cuda.calls) == 1
