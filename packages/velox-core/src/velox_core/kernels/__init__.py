"""Kernel loading: backend detection, sources, and kernels built once per process.

Every hot operation has a pure-MLX reference; a kernel is an optimization that must match
it. :func:`use_kernels` says whether to take the kernel path now: kernels are enabled
(``VELOX_KERNELS`` is not ``0``) and the default device is a GPU whose backend has a build of
the kernel (``mx.fast.metal_kernel`` on Apple GPUs, ``mx.fast.cuda_kernel`` on NVIDIA).
Sources live in the repository's ``metal/`` folder and ship inside the wheels that use them.

Submodules (imported on use, never by this package):

* :mod:`velox_core.kernels.build`: one kernel body instantiated for Metal or CUDA
  (``KernelSpec``), and the full sources MLX generates around it, for compile checks;
* :mod:`velox_core.kernels.decode`: fused split-K decode attention over packed codes;
* :mod:`velox_core.kernels.encode`: fused quantize-and-pack (affine and codebook codes);
* :mod:`velox_core.kernels.emulate`: the Metal instantiation run on the CPU through the C++
  shim in ``metal/shim`` (a test aid).

See docs/performance.md.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from importlib import resources
from pathlib import Path
from typing import Any

import mlx.core as mx

__all__ = [
    "backend",
    "env_choice",
    "env_setting",
    "get_kernel",
    "kernel_source",
    "kernels_enabled",
    "use_kernels",
]

_BUILT: dict[tuple[str, str], Any] = {}


# os.environ.get encodes the name and decodes the value on every call (about half a
# microsecond), and a decode step reads about 15 settings per layer. On POSIX, CPython keeps
# the environment as bytes in os.environ._data, which every write through os.environ updates
# (pytest's monkeypatch included): a dict lookup reads the same values. Elsewhere (or should
# that attribute go away) os.environ.get.
_ENV_DATA = getattr(os.environ, "_data", None) if os.name == "posix" else None
_ENV_KEYS: dict[str, bytes] = {}


def env_setting(name: str, default: str | None = None) -> str | None:
    """``os.environ.get(name, default)``, read without its per-call encoding on POSIX."""
    data = _ENV_DATA
    if not isinstance(data, dict):
        return os.environ.get(name, default)
    key = _ENV_KEYS.get(name)
    if key is None:
        key = _ENV_KEYS[name] = os.fsencode(name)
    value = data.get(key)
    return default if value is None else os.fsdecode(value)


def env_choice(name: str, choices: tuple[str, ...]) -> str | None:
    """A kernel setting that takes one of ``choices``: None where the environment leaves it
    unset (or empty), else its value; anything else is a ValueError naming the choices."""
    value = (env_setting(name) or "").strip()
    if not value:
        return None
    if value not in choices:
        alts = (
            " or ".join((", ".join(choices[:-1]), choices[-1])) if len(choices) > 1 else choices[0]
        )
        raise ValueError(f"{name} must be {alts}, got {value!r}")
    return value


def kernels_enabled() -> bool:
    """False when the environment sets ``VELOX_KERNELS=0`` (reference MLX everywhere)."""
    return env_setting("VELOX_KERNELS", "1").strip() not in ("0", "false", "no", "off")


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
    return kernels_enabled() and backend() in ("metal", "cuda")


def _source_dirs(package: str) -> list[Path]:
    dirs = []
    try:
        dirs.append(Path(str(resources.files(package) / "kernels" / "src")))
    except (ModuleNotFoundError, TypeError):
        pass
    here = Path(__file__).resolve()
    for parent in here.parents:
        if (parent / "metal").is_dir() and (parent / "packages").is_dir():
            dirs.append(parent / "metal")
            break
    return dirs


def kernel_source(filename: str, package: str = "velox_core") -> str:
    """Text of a kernel source file, from the installed wheel or the repository's ``metal/``."""
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
