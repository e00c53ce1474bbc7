"""Kernel loading: backend detection, sources, and kernels built once per process.

Every hot operation has a pure-MLX reference; a kernel is an optimization that must match
it. :func:`use_kernels` says whether to take the kernel path now: kernels are enabled
(:func:`kernel_config`, :mod:`velox_core.kernels.config`; ``VELOX_KERNELS=0`` turns them
off) and the default device is a GPU whose backend has a build of the kernel
(``mx.fast.metal_kernel`` on Apple GPUs, ``mx.fast.cuda_kernel`` on NVIDIA).
velox-core's sources live in the repository's ``metal/`` folder and ship inside its wheel; a
method package ships the kernel sources of its own layouts in its ``metal/`` folder.

Submodules (imported on use, never by this package):

* :mod:`velox_core.kernels.build`: one kernel body instantiated for Metal or CUDA
  (``KernelSpec``), and the full sources MLX generates around it, for compile checks;
* :mod:`velox_core.kernels.config`: the kernels' typed configuration (:class:`KernelConfig`);
* :mod:`velox_core.kernels.decode`: fused split-K decode attention over packed codes, the
  plan from a segment's records to the launches (its pieces in ``layout``, ``portable``,
  ``mma``, ``mma_support``, ``merge``);
* :mod:`velox_core.kernels.encode`: fused quantize-and-pack (affine codes, sign sketches).

The CPU emulation of the kernels (their Metal instantiation run through the C++ shim in
``metal/shim``) is a test aid: :mod:`velox_testing.emulate`, in velox-testing.

See docs/performance.md.
"""

from __future__ import annotations

from collections.abc import Callable
from importlib import resources
from pathlib import Path
from typing import Any

import mlx.core as mx

from .config import kernel_config

__all__ = ["backend", "use_kernels"]

_BUILT: dict[tuple[str, str], Any] = {}


def kernels_enabled() -> bool:
    """False where the kernels are turned off (``KernelConfig.enabled``, from
    ``VELOX_KERNELS=0``): reference MLX everywhere."""
    return kernel_config().enabled


def backend() -> str:
    """``"metal"``, ``"cuda"`` or ``"cpu"``: where the default device runs."""
    if mx.default_device().type != mx.DeviceType.gpu:
        return "cpu"
    if mx.metal.is_available():
        return "metal"
    if hasattr(mx, "cuda") and mx.cuda.is_available():
        return "cuda"
    return "cpu"


def use_kernels() -> bool:
    """True where velox's kernels run: turned on (:func:`kernels_enabled`) on Metal or CUDA."""
    return kernel_config().enabled and backend() in ("metal", "cuda")


def _source_dirs(package: str) -> list[Path]:
    dirs = []
    try:
        root = resources.files(package)
        # velox-core's wheel: kernels/src (copied from metal/); a method package: its metal/
        dirs += [Path(str(root / "kernels" / "src")), Path(str(root / "metal"))]
    except (ModuleNotFoundError, TypeError):
        pass
    here = Path(__file__).resolve()
    for parent in here.parents:
        if (parent / "metal").is_dir() and (parent / "packages").is_dir():
            dirs.append(parent / "metal")
            break
    return dirs


def kernel_source(filename: str, package: str = "velox_core") -> str:
    """Text of a kernel source file shipped by ``package`` (velox-core's ``kernels/src``, a
    method package's ``metal/`` folder), or in the repository's ``metal/``."""
    for d in _source_dirs(package):
        p = d / filename
        if p.is_file():
            return p.read_text()
    raise FileNotFoundError(f"kernel source {filename!r} not found for {package}")


def get_kernel(name: str, build: Callable[[str], Any]) -> Any:
    """The kernel ``name`` for the current backend, built once by ``build(backend)``."""
    key = (name, backend())
    if key not in _BUILT:
        _BUILT[key] = build(key[1])
    return _BUILT[key]
