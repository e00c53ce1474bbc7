"""Checks of a codec's fused-kernel path that the method packages' kernel tests share."""

from __future__ import annotations

import concurrent.futures
import re
import shutil
import subprocess
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
import pytest

import velox_core.kernels as vk
from velox_core import environment
from velox_core.cache.attention import Segment, fused_partial, kernel_sides, partial

from .kv import assert_partials_close

__all__ = [
    "assert_cpu_declines",
    "assert_kernel_partial",
    "assert_step_like_reference",
    "compile_cuda",
    "compile_metal",
    "emulated_gpu_fixture",
    "needs_gxx",
    "needs_nvcc",
    "sign_words",
]

# marks a test that runs kernels through the C++ emulation (velox_testing.emulate)
needs_gxx = pytest.mark.skipif(
    shutil.which("g++") is None, reason="g++ is not installed: the kernels cannot be emulated"
)


# marks a test that compiles the CUDA instantiations with nvcc
needs_nvcc = pytest.mark.skipif(
    shutil.which("nvcc") is None,
    reason="nvcc is not installed: the CUDA instantiation cannot be compiled here",
)


# a kernel's two instantiations as ``pytest.mark.parametrize`` values (``backend``), each
# skipped where its compiler is missing: the argument :func:`compile_instantiation` takes
INSTANTIATIONS = (
    pytest.param("metal", marks=needs_gxx, id="metal"),
    pytest.param("cuda", marks=needs_nvcc, id="cuda"),
)


def assert_ships(spec: Any, package: str) -> None:
    """``spec`` (a ``velox_core.kernels.build.KernelSpec``) has its source shipped with
    ``package`` (not empty), and each backend's body starts with that backend's prologue and
    its header includes the shared kernels' header."""
    from velox_core.kernels import kernel_source
    from velox_core.kernels.build import PROLOGUE

    assert kernel_source(spec.source, package).strip(), (spec.source, package)
    for backend in ("metal", "cuda"):
        assert spec.body(backend).startswith(PROLOGUE[backend]), (spec.source, backend)
        assert "VELOX_KERNELS_H" in spec.header(backend), (spec.source, backend)


def compile_instantiation(
    backend: str, variants: Sequence[Sequence[Any]], workdir: Path, unit_each: bool = False
) -> None:
    """Compile a kernel's ``variants`` (each the arguments of ``metal_source`` and
    ``cuda_source``: spec, argument infos, output dtypes, template) in ``backend``'s
    instantiation: ``"metal"`` through :func:`compile_metal`, ``"cuda"`` through
    :func:`compile_cuda`, all in one unit or, with ``unit_each``, a unit a variant (a kernel
    with launch bounds re-defines ``__global__``)."""
    from velox_core.kernels.build import cuda_source

    from .metal_source import metal_source

    if backend == "metal":
        compile_metal([metal_source(*v)[0] for v in variants], workdir)
    elif backend == "cuda":
        sources = [cuda_source(*v)[0] for v in variants]
        compile_cuda([[src] for src in sources] if unit_each else [sources], workdir)
    else:
        raise ValueError(f"backend must be 'metal' or 'cuda', got {backend!r}")


def compile_metal(sources: Sequence[str], workdir: Path) -> None:
    """Compile Metal instantiations (``velox_testing.metal_source.metal_source``'s texts) as one
    unit through the C++ shim of Metal (``g++ -fsyntax-only``); fails the test with the
    compiler's message. Each kernel binds at most 31 buffers, its slots numbered from 0."""
    from .emulate import compiler, shim_dir

    for src in sources:
        slots = [int(i) for i in re.findall(r"\[\[buffer\((\d+)\)\]\]", src)]
        assert sorted(slots) == list(range(len(slots))) and len(slots) <= 31, slots
    cpp = Path(workdir) / "metal_kernels.cpp"
    cpp.write_text('#include "metal_shim.h"\n' + "\n".join(sources))
    cmd = [compiler() or "g++", "-std=c++17", "-fsyntax-only", "-Wall", "-Wno-attributes"]
    res = subprocess.run(
        [*cmd, "-Wno-unused", "-I", str(shim_dir()), str(cpp)],
        capture_output=True,
        text=True,
        check=False,
    )
    assert res.returncode == 0, res.stderr[-6000:]


def compile_cuda(units: Sequence[Sequence[str]], workdir: Path, spill_bytes: int = 0) -> str:
    """Compile CUDA translation units (each a list of kernels' sources, as
    ``velox_core.kernels.build.cuda_source`` writes them) with nvcc for sm_90a, two at a time;
    assert success and spill stores of at most ``spill_bytes`` per kernel; returns ptxas' log
    in unit order. A kernel with ``__launch_bounds__`` re-defines ``__global__`` for the rest
    of its unit: it must be a unit of its own (as MLX compiles each kernel). Device code only
    (``-cubin``, as MLX compiles a kernel through NVRTC). MLX's device headers come from
    ``VELOX_MLX_CUDA_INCLUDE`` or the stand-in in ``metal/shim/cuda``."""
    from .emulate import shim_dir

    nvcc = shutil.which("nvcc")
    assert nvcc is not None, "nvcc is not installed"
    inc = environment.get("VELOX_MLX_CUDA_INCLUDE") or str(shim_dir() / "cuda")
    work = Path(workdir)

    def compile_unit(i: int) -> str:
        cu = work / f"kernels{i}.cu"
        cu.write_text("\n".join(units[i]))
        cmd = [nvcc, "-std=c++17", "-arch=sm_90a", "-Xptxas", "-v", "-I", inc, "-cubin", str(cu)]
        res = subprocess.run(
            [*cmd, "-o", str(work / f"k{i}.cubin")], capture_output=True, text=True, check=False
        )
        assert res.returncode == 0, res.stderr[-6000:]
        found = re.findall(r"(\d+) bytes spill stores", res.stderr)
        assert len(found) == len(units[i]), res.stderr[-3000:]
        assert all(int(f) <= spill_bytes for f in found), res.stderr[-3000:]
        return res.stderr

    with concurrent.futures.ThreadPoolExecutor(max_workers=2) as pool:
        return "".join(pool.map(compile_unit, range(len(units))))


def emulated_gpu_fixture() -> Callable[..., Any]:
    """A fixture ``emulated_gpu``: the kernels run emulated on the CPU for the test (what
    :func:`velox_testing.emulate.emulated_or_skip` returns, built in the test's
    ``tmp_path``), or the test is skipped where they cannot be. A test module binds it once,
    ``emulated_gpu = emulated_gpu_fixture()``, and its tests take ``emulated_gpu``."""

    @pytest.fixture
    def emulated_gpu(monkeypatch: Any, tmp_path: Any) -> Any:
        from .emulate import emulated_or_skip

        return emulated_or_skip(monkeypatch, tmp_path)

    return emulated_gpu


def assert_cpu_declines(
    key_codec: Any, keys: Any, value_codec: Any, values: Any, q_shape=(1, 2, 4, 128)
) -> None:
    """On the CPU the segment does not reach the fused kernels: no kernel sides
    (:func:`velox_core.cache.attention.kernel_sides`) and no fused partial (the caller takes
    the reference path). Skips the test where the default device is a GPU.

    Shapes:
        keys, values: ``Packed`` records of ``(B, H, T, D)`` vectors; q_shape ``(B, H, M, D)``,
        the queries.
    """
    if mx.default_device().type == mx.DeviceType.gpu:
        pytest.skip("the default device is a GPU")
    assert kernel_sides(key_codec, keys, value_codec, values, q_shape) is None
    seg = Segment(key_codec, keys, value_codec, values)
    assert fused_partial(mx.zeros(q_shape), seg) is None


def assert_kernel_partial(
    emulated: Any,
    q: mx.array,
    key_codec: Any,
    keys: Any,
    value_codec: Any,
    values: Any,
    tol: float,
    kernel: str | None = None,
) -> None:
    """The segment's fused partial, run through ``emulated`` (the ``emulated_gpu`` fixture's
    kernels), launches the portable decode attention kernel (a layout's key pass in it
    included: ``velox_decode_attention_<layout>``; exactly the kernel named ``kernel`` if
    given) and the merge only, and equals the reference partial
    (:func:`velox_core.cache.attention.partial`) within ``tol``.

    Shapes:
        q ``(B, H_q, M, D)``; keys, values: ``Packed`` records of ``(B, H, T, D)`` vectors.
    """
    emulated.calls.clear()  # launches of the encode kernels that made the records
    got = fused_partial(q, Segment(key_codec, keys, value_codec, values))
    names = emulated.names
    assert len(names) == 2 and names[1] == "velox_decode_merge", names
    if kernel is not None:
        assert names[0] == kernel, names
    assert names[0] == "velox_decode_attention" or names[0].startswith("velox_decode_attention_")
    ref = partial(q, Segment(key_codec, keys, value_codec, values))
    assert_partials_close(got, ref, tol)


def assert_step_like_reference(
    emulated: Any,
    monkeypatch: Any,
    make: Callable[[], Any],
    k: mx.array,
    v: mx.array,
    q: mx.array,
    kernel: str = "velox_decode_attention",
) -> tuple[Any, Any]:
    """A cache from ``make()`` filled with ``k``, ``v`` takes, for its decode step on ``q``,
    the decode kernel named ``kernel`` and the merge that joins its fp16 tokens, both run by
    ``emulated`` (the ``emulated_gpu`` fixture's kernels, or an installed
    :class:`~velox_testing.emulate.EmulatedKernels`), and attends as a second cache from
    ``make()`` filled the same way on the reference path (the backend reported as the CPU,
    through ``monkeypatch`` for the rest of the test) to 2e-3; returns the two caches.

    Shapes:
        k, v ``(B, H, T, D)``; q ``(B, H_q, 1, D)``.
    """
    cache = make()
    cache.update_and_fetch(k, v)
    emulated.calls.clear()  # launches of the encode kernels that filled it
    got = cache.attend(q, 0.088)
    assert emulated.names == [kernel, "velox_decode_merge_fp16"], emulated.names
    monkeypatch.setattr(vk, "backend", lambda: "cpu")  # the reference path
    ref_cache = make()
    ref_cache.update_and_fetch(k, v)
    ref = ref_cache.attend(q, 0.088)
    assert np.abs(np.asarray((got - ref).astype(mx.float32))).max() < 2e-3
    return cache, ref_cache


def sign_words(sx: np.ndarray) -> np.ndarray:
    """velox's packing of sign bits (1 where ``S x >= 0``), written independently of
    :func:`velox_core.ops.pack`: row i is bit i % 32 of word i // 32, the last word's bits
    past the rows zero.

    Shapes:
        sx ``(..., n)`` (``S x`` per row); returns uint32 ``(..., ceil(n / 32))``.
    """
    n = sx.shape[-1]
    bits = np.zeros((*sx.shape[:-1], -(-n // 32) * 32), np.uint64)
    bits[..., :n] = sx >= 0
    words = bits.reshape(*sx.shape[:-1], -1, 32) << np.arange(32, dtype=np.uint64)
    return words.sum(-1).astype(np.uint32)
