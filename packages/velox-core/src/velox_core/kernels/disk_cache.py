"""velox's CUDA kernels compiled once per machine, not once per process.

MLX compiles a custom CUDA kernel (``mx.fast.cuda_kernel``) with NVRTC the first time a
process evaluates it and keeps the result in memory only: ``CustomKernel::eval_gpu`` asks
for its module with ``use_disk_cache=false``. Yet every module MLX loads looks in MLX's PTX
disk cache first (``JitModule``: ``read_cached_ptx`` before ``compile``). So velox compiles
its kernel itself, the exact source MLX would compile with MLX's NVRTC options, and writes
the result where MLX looks; every later process (and this one, a moment later) loads it
instead of compiling:

* directory: ``$MLX_PTX_CACHE_DIR``, else ``$TMPDIR`` (or ``/tmp``) ``/mlx/<version>/ptx``;
* module: ``custom_kernel_<name><template hash>_<std::hash of the source, hex>``, the file
  ``<module>.ptx`` (the cubin, or PTX where NVRTC cannot target the device's SASS) and
  ``<module>.txt`` (``mlx::core::cu::<kernel>``, a tab, its mangled name);
* options: ``--device-as-default-execution-space``, ``--gpu-architecture=sm_<cc>[a]``, and
  the include paths of MLX's bundled headers, CCCL and the CUDA runtime headers.

MLX compiles with its device headers embedded in libmlx (``mlx/backend/cuda/device/*.cuh``);
its wheels do not install them. The generated source includes one of them, ``utils.cuh``,
for the ``Shape`` and ``Strides`` parameter types and the half types: velox's NVRTC call
gives it ``metal/mlx_device_utils.cuh`` under that name instead, which declares those types
as MLX passes them (arrays of ``MAX_NDIM`` integers; checked against the ``config.h`` MLX
installs). velox's kernel bodies use nothing else of MLX's headers (their CUDA compile checks
in CI build against the same stand-in).

The source is :func:`velox_core.kernels.build.cuda_source` (``build_kernel``'s text), and
the module name hashes it with libstdc++'s ``std::hash<std::string>``
(:func:`std_hash`), which MLX's Linux wheels use. Where any of it does not match an MLX
version, MLX finds no file under the name it computes and compiles the kernel itself, as
it does without this module: a mismatch costs time, never a wrong result, since the file
is the compiled form of MLX's own source. It applies to the MLX releases it follows
(:data:`MLX_VERSIONS`); ``KernelConfig.disk_cache`` (``VELOX_KERNEL_CACHE=0``) turns it off.

Compiles run in a small pool of threads (:func:`compile_ahead`: NVRTC is CPU work, and ctypes
lets go of the GIL during it), each kernel once per process: a call of a variant whose compile
is in flight waits for it. A block of calls that needs several new variants at once (a write's
key and value encodes, a decode plan's kernel and merge) starts them together and waits at its
end (:func:`compiled_together`); a cache on CUDA starts the variants of its first decode step
during the prefill, from launches it only records (:func:`compiling_ahead`,
:meth:`velox_core.cache.planned.PlannedAttention.plan_ahead`).
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import os
import re
import sys
import tempfile
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from pathlib import Path
from typing import Any

import mlx.core as mx

from .. import kernels as _kernels  # backend() looked up per call (tests report another)
from . import nvrtc
from .config import kernel_config

__all__: list[str] = []

_MASK = (1 << 64) - 1
_MUL = (0xC6A4A793 << 32) + 0x5BD1E995
_SEED = 0xC70F6907
_MAX_FILE_NAME = 245  # get_ptx_path: longer module names become nested folders


def _shift_mix(v: int) -> int:
    return v ^ (v >> 47)


def std_hash(data: bytes) -> int:
    """libstdc++'s ``std::hash<std::string>`` of ``data`` on a 64-bit little-endian host
    (``std::_Hash_bytes(data, len, 0xc70f6907)``)."""
    n = len(data)
    h = (_SEED ^ (n * _MUL)) & _MASK
    whole = n & ~7
    for i in range(0, whole, 8):
        w = int.from_bytes(data[i : i + 8], "little")
        h ^= (_shift_mix((w * _MUL) & _MASK) * _MUL) & _MASK
        h = (h * _MUL) & _MASK
    if n & 7:
        h ^= int.from_bytes(data[whole:], "little")
        h = (h * _MUL) & _MASK
    h = (_shift_mix(h) * _MUL) & _MASK
    return _shift_mix(h)


def module_name(kernel_name: str, source: str) -> str:
    """The module name MLX gives a custom kernel (``CustomKernel::eval_gpu``)."""
    return f"{kernel_name}_{std_hash(source.encode()):x}"


@functools.cache
def ptx_cache_dir() -> Path:
    """MLX's PTX disk cache (``ptx_cache_dir`` in ``jit_module.cpp``)."""
    env = os.environ.get("MLX_PTX_CACHE_DIR")
    if env:
        return Path(env)
    return Path(os.environ.get("TMPDIR") or "/tmp") / "mlx" / mx.__version__ / "ptx"


def ptx_path(module: str) -> Path:
    """Where MLX looks for ``module`` (``get_ptx_path``)."""
    if len(module) <= _MAX_FILE_NAME:
        return ptx_cache_dir() / (module + ".ptx")
    path, offset = ptx_cache_dir(), 0
    while len(module) - offset > _MAX_FILE_NAME:
        path /= module[offset : offset + _MAX_FILE_NAME]
        offset += _MAX_FILE_NAME
    return path / (module[offset:] + ".ptx")


# -- NVRTC, as MLX calls it -----------------------------------------------------------------------


@functools.cache
def _nvrtc() -> tuple[Any, str]:
    """The NVRTC library MLX loaded (found by its soname), or one of the CUDA toolkit's, and
    its name (:func:`velox_core.kernels.nvrtc.load`)."""
    site = Path(mx.__file__).resolve().parents[1]
    return nvrtc.load(str(p) for p in sorted(site.glob("nvidia/*/lib/libnvrtc.so*")))


@functools.cache
def _compute_capability(ordinal: int) -> tuple[int, int]:
    lib = ctypes.CDLL("libcuda.so.1")
    dev, major, minor = ctypes.c_int(), ctypes.c_int(), ctypes.c_int()
    if lib.cuInit(0) or lib.cuDeviceGet(ctypes.byref(dev), ordinal):
        raise OSError("the CUDA driver gives no device")
    # CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR / _MINOR
    if lib.cuDeviceGetAttribute(ctypes.byref(major), 75, dev) or lib.cuDeviceGetAttribute(
        ctypes.byref(minor), 76, dev
    ):
        raise OSError("the CUDA driver gives no compute capability")
    return major.value, minor.value


_UTILS = "mlx/backend/cuda/device/utils.cuh"


@functools.cache
def _utils_standin() -> bytes:
    """The stand-in for MLX's ``utils.cuh``, if its ``MAX_NDIM`` is the installed MLX's."""
    from . import kernel_source

    text = kernel_source("mlx_device_utils.cuh")
    config = (
        Path(mx.__file__).resolve().parent / "include" / _UTILS.replace("utils.cuh", "config.h")
    )
    mine = re.search(r"#define MAX_NDIM (\d+)", text)
    theirs = re.search(r"#define MAX_NDIM (\d+)", config.read_text()) if config.exists() else None
    if mine is None or theirs is None or mine.group(1) != theirs.group(1):
        raise OSError(f"MLX's MAX_NDIM ({config}) is not the stand-in's: kernels not kept on disk")
    return text.encode()


@functools.cache
def _include_args() -> tuple[str, ...]:
    """``include_path_args`` of ``jit_module.cpp``: MLX's bundled headers, CCCL, CUDA's."""
    root = Path(mx.__file__).resolve().parent  # site-packages/mlx
    args = []
    include = root / "include"
    if include.exists():
        args.append(f"--include-path={include}")
    if (include / "cccl").exists():
        args.append(f"--include-path={include / 'cccl'}")
    cuda = root.parent / "nvidia" / "cu13" / "include"
    if not cuda.exists():
        home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH") or "/usr/local/cuda"
        cuda = Path(home) / "include"
    args.append(f"--include-path={cuda}")
    return tuple(args)


def compile_cuda(source: str, kernel: str, file_name: str) -> tuple[bytes, str]:
    """``source`` compiled as MLX's ``compile`` does: (cubin or PTX, mangled name of
    ``kernel``); in a worker process of its own where ``KernelConfig.compile_processes`` says
    so (:mod:`velox_core.kernels.nvrtc`), else in this one."""
    lib, library = _nvrtc()
    major, minor = _compute_capability(getattr(mx.default_device(), "index", 0) or 0)
    cubin = nvrtc.version(lib) >= (11, 8)
    arch = "{}_{}{}{}".format("sm" if cubin else "compute", major, minor, "a" if major >= 9 else "")
    options = ["--device-as-default-execution-space", f"--gpu-architecture={arch}"]
    options += _include_args()
    job = nvrtc.Job(source, kernel, file_name, tuple(options), {_UTILS: _utils_standin()}, cubin)
    if kernel_config().compile_processes:
        return nvrtc.compile_in_worker(library, job)
    return nvrtc.compile_program(lib, job)


def write_whole(path: Path, data: bytes) -> None:
    """``data`` at ``path``, whole or not at all (a rename, so a concurrent reader sees no
    partial file)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".velox-")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _compile_into(path: Path, module: str, kernel_name: str, source: str) -> Path:
    if not path.exists():
        full = "mlx::core::cu::" + kernel_name
        binary, mangled = compile_cuda(source, full, module + ".cu")
        # the names file first: MLX reads it once it finds the binary
        write_whole(path.with_suffix(".txt"), f"{full}\t{mangled}\n".encode())
        write_whole(path, binary)
    return path


# -- compiles in parallel, and ahead of use -------------------------------------------------------

COMPILE_THREADS = 8  # NVRTC compiles at once, at most (ctypes lets go of the GIL in each)

_lock = threading.RLock()
_inflight: dict[Path, Future] = {}  # cache file -> its compile in flight in this process
_pool: list[ThreadPoolExecutor] = []  # made on the first compile
_local = threading.local()  # .region: the region a thread's kernel calls are made in
kept = False  # whether a kernel of this process keeps its compiled forms on disk (wrap)


def _forked() -> None:
    """In a forked child: none of the parent's compile threads (nor its lock's holder)."""
    global _lock
    _lock = threading.RLock()
    _inflight.clear()
    _pool.clear()


os.register_at_fork(after_in_child=_forked)


def _fail(error: BaseException) -> None:
    """Report ``error`` once and turn the disk cache off for the process: MLX then compiles
    every kernel itself, as without this module."""
    with _lock:
        if CachedKernel.failed:
            return
        CachedKernel.failed = True
    print(
        f"velox: kernels are not kept on disk ({error}); MLX compiles them in every process",
        file=sys.stderr,
    )


def _settled(path: Path, future: Future) -> None:
    with _lock:
        if _inflight.get(path) is future:
            del _inflight[path]
    if not future.cancelled() and future.exception() is not None:
        _fail(future.exception())


def compile_ahead(items: Iterable[tuple[str, str]]) -> list[Future]:
    """Start compiling each ``(source, kernel_name)`` (as :func:`ensure_compiled` takes them)
    in a pool of :data:`COMPILE_THREADS` threads; returns the futures of their cache files.

    A file already there gives a done future; a kernel whose compile is in flight in this
    process gives that compile's future, so no kernel is compiled twice. Files are written
    whole (:func:`write_whole`). A failed compile is reported once and turns the disk cache
    off (MLX compiles every kernel itself)."""
    futures = []
    with _lock:
        for source, kernel_name in items:
            module = module_name(kernel_name, source)
            path = ptx_path(module)
            future = _inflight.get(path)
            if future is None and path.exists():
                future = Future()
                future.set_result(path)
            elif future is None:
                if not _pool:
                    _pool.append(ThreadPoolExecutor(COMPILE_THREADS, "velox-nvrtc"))
                future = _pool[0].submit(_compile_into, path, module, kernel_name, source)
                _inflight[path] = future
                future.add_done_callback(functools.partial(_settled, path))
            futures.append(future)
    return futures


def ensure_compiled(source: str, kernel_name: str) -> Path:
    """The cache file of the kernel ``kernel_name`` MLX builds from ``source`` (the full text
    of :func:`velox_core.kernels.build.cuda_source`), compiled and written if absent; a
    compile of it in flight (:func:`compile_ahead`) is waited for."""
    return compile_ahead([(source, kernel_name)])[0].result()


class _Region:
    """How the kernel calls of a block handle a new variant (see :func:`compiled_together`
    and :func:`compiling_ahead`)."""

    __slots__ = ("ahead", "pending")

    def __init__(self, ahead: bool) -> None:
        self.ahead = ahead
        self.pending: list[Future] = []


@contextlib.contextmanager
def _in(region: _Region | None) -> Iterator[_Region | None]:
    outer = getattr(_local, "region", None)
    _local.region = region
    try:
        yield region
    finally:
        _local.region = outer


@contextlib.contextmanager
def compiled_together() -> Iterator[None]:
    """The new variants of the kernel calls in the block compile together: each call starts
    its compile and goes on (MLX only records a launch; it compiles at evaluation), and the
    block's end waits for them all. For a block that evaluates none of its launches (one that
    does runs it under :func:`at_once`). Where kernels are not compiled ahead
    (:func:`compiles_ahead`) the block changes nothing."""
    if not compiles_ahead():
        yield
        return
    with _in(_Region(False)) as region:
        try:
            yield
        finally:
            if region.pending:  # (a decode step's block mostly starts none)
                wait(region.pending)


@contextlib.contextmanager
def compiling_ahead() -> Iterator[None]:
    """The kernel calls in the block start their variants' compiles in the background and wait
    for none (:meth:`CachedKernel.ahead`): for launches made only to learn their variants and
    never evaluated. The first call of such a variant after the block waits for its compile."""
    with _in(_Region(True)):
        yield


@contextlib.contextmanager
def at_once() -> Iterator[None]:
    """The kernel calls in the block wait for their variants' compiles, as outside any region:
    for a launch evaluated at once (the tensor-core kernel's subnormal probe)."""
    with _in(None):
        yield


class CachedKernel:
    """An ``mx.fast.cuda_kernel`` whose compiled forms land in MLX's PTX disk cache.

    ``render(inputs, output_dtypes, template)`` gives the full source MLX generates for a call
    and its kernel name (:meth:`velox_core.kernels.build.KernelSpec.mlx_source`). Each new
    (template, output dtypes) of a call is compiled into the cache before the call is passed
    on (:func:`ensure_compiled`; in a :func:`compiled_together` block, before the block ends);
    the rest of its calls go straight to MLX (a variant that differs only in input dtypes is
    then compiled by MLX itself: slower, never wrong). A failure to compile or write is
    reported once and turns the cache off for the process: MLX then compiles every kernel
    itself, as without this class. A launch plan calls ``kernel``, the MLX kernel behind the
    wrapper, once its variant went through the wrapper (the tensor-core kernel's and the
    merge's), so that the hot path skips it.
    """

    failed = False  # class-wide: one report, then MLX compiles every kernel itself

    def __init__(self, kernel: Any, render: Callable[..., tuple[str, str]]) -> None:
        self.kernel = kernel
        self.render = render
        self.seen: set[tuple] = set()
        self.started: set[tuple] = set()  # the variants compiled ahead (with input dtypes)
        self.last: Any = None  # the template object of the latest call

    def __call__(
        self,
        *,
        inputs: Sequence[Any],
        output_dtypes: Sequence[Any],
        template: Sequence[tuple[str, Any]] = (),
        **kwargs: Any,
    ) -> Any:
        # a planned launch passes the same template object every step: that call skips the key
        if not CachedKernel.failed and template is not self.last:
            region = getattr(_local, "region", None)
            if region is not None and region.ahead:
                self.ahead(inputs, output_dtypes, template)
            else:
                self.last = template
                key = (tuple(template), tuple(output_dtypes))
                if key not in self.seen:
                    self.seen.add(key)
                    try:
                        item = self.render(inputs, output_dtypes, template)
                        if region is None:
                            ensure_compiled(*item)
                        else:
                            region.pending += compile_ahead([item])
                    except Exception as e:  # any failure: MLX compiles the kernel itself
                        _fail(e)
        return self.kernel(inputs=inputs, output_dtypes=output_dtypes, template=template, **kwargs)

    def ahead(
        self,
        inputs: Sequence[Any],
        output_dtypes: Sequence[Any],
        template: Sequence[tuple[str, Any]] = (),
    ) -> None:
        """Start compiling the variant of a call with these arguments in the background,
        launching nothing (:func:`compile_ahead`), unless a call of it went through the
        wrapper already or it was started before."""
        key = (tuple(template), tuple(output_dtypes))
        if CachedKernel.failed or key in self.seen:
            return
        variant = (*key, tuple((str(a.dtype), a.ndim) for a in inputs))
        if variant not in self.started:
            self.started.add(variant)
            try:
                compile_ahead([self.render(inputs, output_dtypes, template)])
            except Exception as e:  # any failure: MLX compiles the kernel itself
                _fail(e)


# MLX releases whose module naming, cache layout and generated source this module follows
# (checked on an NVIDIA GPU: the source MLX prints with verbose=True equals cuda_source's)
MLX_VERSIONS = ("0.32.",)


def _kept() -> bool:
    return kernel_config().disk_cache and mx.__version__.startswith(MLX_VERSIONS)


def wrap(kernel: Any, render: Callable[..., tuple[str, str]]) -> Any:
    """``kernel`` with its compiled forms kept on disk, where the configuration asks for it
    and MLX is a release this module follows (:data:`MLX_VERSIONS`; others compile every
    kernel themselves, as without this module)."""
    global kept
    if not _kept():
        return kernel
    kept = True
    return CachedKernel(kernel, render)


def compiles_ahead() -> bool:
    """Whether kernels are compiled ahead of use here: on CUDA, with their compiled forms kept
    on disk (:func:`wrap`) and no failure reported; never on the CPU or Metal, nor with
    ``KernelConfig.disk_cache`` or ``KernelConfig.compile_ahead`` off."""
    on = _kernels.backend() == "cuda" and not CachedKernel.failed and _kept()
    return on and kernel_config().compile_ahead
