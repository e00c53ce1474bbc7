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
"""

from __future__ import annotations

import ctypes
import functools
import os
import re
import sys
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import mlx.core as mx

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
def _nvrtc() -> Any:
    """The NVRTC library MLX loaded (found by its soname), or one of the CUDA toolkit's."""
    names = ["libnvrtc.so.13", "libnvrtc.so.12", "libnvrtc.so"]
    site = Path(mx.__file__).resolve().parents[1]
    names += [str(p) for p in sorted(site.glob("nvidia/*/lib/libnvrtc.so*"))]
    for name in names:
        try:
            lib = ctypes.CDLL(name)
        except OSError:
            continue
        lib.nvrtcGetErrorString.restype = ctypes.c_char_p
        return lib
    raise OSError("no NVRTC library found (libnvrtc.so.13 or .12)")


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


def _check(lib: Any, result: int, what: str) -> None:
    if result != 0:
        raise RuntimeError(f"{what}: {lib.nvrtcGetErrorString(result).decode()}")


def compile_cuda(source: str, kernel: str, file_name: str) -> tuple[bytes, str]:
    """``source`` compiled as MLX's ``compile`` does: (cubin or PTX, mangled name of
    ``kernel``)."""
    lib = _nvrtc()
    major, minor = _compute_capability(getattr(mx.default_device(), "index", 0) or 0)
    nv_major, nv_minor = ctypes.c_int(), ctypes.c_int()
    _check(lib, lib.nvrtcVersion(ctypes.byref(nv_major), ctypes.byref(nv_minor)), "nvrtcVersion")
    sass = (nv_major.value, nv_minor.value) >= (11, 8)
    arch = "{}_{}{}{}".format("sm" if sass else "compute", major, minor, "a" if major >= 9 else "")
    options = ["--device-as-default-execution-space", f"--gpu-architecture={arch}"]
    options += _include_args()
    prog = ctypes.c_void_p()
    headers = (ctypes.c_char_p * 1)(_utils_standin())
    names = (ctypes.c_char_p * 1)(_UTILS.encode())
    _check(
        lib,
        lib.nvrtcCreateProgram(
            ctypes.byref(prog), source.encode(), file_name.encode(), 1, headers, names
        ),
        "nvrtcCreateProgram",
    )
    try:
        _check(lib, lib.nvrtcAddNameExpression(prog, kernel.encode()), "nvrtcAddNameExpression")
        argv = (ctypes.c_char_p * len(options))(*(o.encode() for o in options))
        result = lib.nvrtcCompileProgram(prog, len(options), argv)
        if result != 0:
            size = ctypes.c_size_t()
            lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
            log = ctypes.create_string_buffer(size.value + 1)
            lib.nvrtcGetProgramLog(prog, log)
            raise RuntimeError(f"NVRTC failed on {kernel}: {log.value.decode(errors='replace')}")
        mangled = ctypes.c_char_p()
        _check(
            lib,
            lib.nvrtcGetLoweredName(prog, kernel.encode(), ctypes.byref(mangled)),
            "nvrtcGetLoweredName",
        )
        lowered = mangled.value.decode()
        size = ctypes.c_size_t()
        get_size, get = (
            (lib.nvrtcGetCUBINSize, lib.nvrtcGetCUBIN)
            if sass
            else (lib.nvrtcGetPTXSize, lib.nvrtcGetPTX)
        )
        _check(lib, get_size(prog, ctypes.byref(size)), "nvrtcGet(CUBIN|PTX)Size")
        buf = ctypes.create_string_buffer(size.value)
        _check(lib, get(prog, buf), "nvrtcGet(CUBIN|PTX)")
        return buf.raw, lowered
    finally:
        lib.nvrtcDestroyProgram(ctypes.byref(prog))


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


def ensure_compiled(source: str, kernel_name: str) -> Path:
    """The cache file of the kernel ``kernel_name`` MLX builds from ``source`` (the full text
    of :func:`velox_core.kernels.build.cuda_source`), compiled and written if absent."""
    module = module_name(kernel_name, source)
    path = ptx_path(module)
    if not path.exists():
        full = "mlx::core::cu::" + kernel_name
        binary, mangled = compile_cuda(source, full, module + ".cu")
        # the names file first: MLX reads it once it finds the binary
        write_whole(path.with_suffix(".txt"), f"{full}\t{mangled}\n".encode())
        write_whole(path, binary)
    return path


class CachedKernel:
    """An ``mx.fast.cuda_kernel`` whose compiled forms land in MLX's PTX disk cache.

    ``render(inputs, output_dtypes, template)`` gives the full source MLX generates for a call
    and its kernel name (:meth:`velox_core.kernels.build.KernelSpec.mlx_source`). Each new
    (template, output dtypes) of a call is compiled into the cache before the call is passed
    on (:func:`ensure_compiled`); the rest of its calls go straight to MLX (a variant that
    differs only in input dtypes is then compiled by MLX itself: slower, never wrong). A
    failure to compile or write is reported once and turns the cache off for the process:
    MLX then compiles every kernel itself, as without this class. A launch plan calls
    ``kernel``, the MLX kernel behind the wrapper, once its variant went through the wrapper
    (the tensor-core kernel's and the merge's), so that the hot path skips it.
    """

    failed = False  # class-wide: one report, then MLX compiles every kernel itself

    def __init__(self, kernel: Any, render: Callable[..., tuple[str, str]]) -> None:
        self.kernel = kernel
        self.render = render
        self.seen: set[tuple] = set()
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
            self.last = template
            key = (tuple(template), tuple(output_dtypes))
            if key not in self.seen:
                self.seen.add(key)
                try:
                    ensure_compiled(*self.render(inputs, output_dtypes, template))
                except Exception as e:  # any failure: MLX compiles the kernel itself
                    CachedKernel.failed = True
                    print(
                        f"velox: kernels are not kept on disk ({e}); MLX compiles them in "
                        "every process",
                        file=sys.stderr,
                    )
        return self.kernel(inputs=inputs, output_dtypes=output_dtypes, template=template, **kwargs)


# MLX releases whose module naming, cache layout and generated source this module follows
# (checked on an NVIDIA GPU: the source MLX prints with verbose=True equals cuda_source's)
MLX_VERSIONS = ("0.32.",)


def wrap(kernel: Any, render: Callable[..., tuple[str, str]]) -> Any:
    """``kernel`` with its compiled forms kept on disk, where the configuration asks for it
    and MLX is a release this module follows (:data:`MLX_VERSIONS`; others compile every
    kernel themselves, as without this module)."""
    if not kernel_config().disk_cache or not mx.__version__.startswith(MLX_VERSIONS):
        return kernel
    return CachedKernel(kernel, render)
