"""Every ``VELOX_*`` environment variable velox reads, besides the kernels' own.

The kernels' variants and tuning are read once, at first use, by
:mod:`velox_core.kernels.config` (its ``ENVIRONMENT`` table; ``VELOX_KERNELS=0`` among them).
The other names are settings of where things are and of the ``velox`` command, read here
and nowhere else (``tests/test_environment.py`` walks the sources for reads elsewhere; where
per-model artifacts are looked up is :func:`search_dirs`):

====================  ===========================================================================
``VELOX_ARTIFACTS``   colon-separated folders searched for per-model artifacts, before
                      ``~/.cache/velox`` (:func:`search_dirs`)
``VELOX_SHARED``      the folder holding the project's shared assets (the reference model,
                      its sibling, data, the artifacts fitted for them), where no repository
                      checkout is found
``VELOX_CACHE_DIR``   where the ``velox`` command keeps models it converts (default
                      ``$XDG_CACHE_HOME/velox`` or ``~/.cache/velox``)
``VELOX_BLAS``        the ``velox`` command's BLAS on Linux: a library path, or ``off`` for
                      MLX's own (``velox_cli.blas``)
``VELOX_NO_OPENBLAS`` the earlier spelling of ``VELOX_BLAS=off``, still honoured
``VELOX_BLAS_ACTIVE`` set by the ``velox`` command in the process it re-executes with a BLAS
                      preloaded: that library's path
``VELOX_MLX_CUDA_INCLUDE``  tests only: the folder holding MLX's CUDA device headers, for the
                      nvcc compile checks (:func:`velox_testing.compile_cuda`; default the
                      stand-in in ``metal/shim/cuda``)
``VELOX_EMU_CACHE``   tests only: a folder the kernel emulator keeps its compiled programs in,
                      shared by processes (:mod:`velox_testing.emulate`; the noxfile sets it
                      to ``.nox/emu-cache``); unset, each emulator's own folder
====================  ===========================================================================
"""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["get", "paths", "put", "search_dirs", "with_setting"]

NAMES = (
    "VELOX_ARTIFACTS",
    "VELOX_SHARED",
    "VELOX_CACHE_DIR",
    "VELOX_BLAS",
    "VELOX_NO_OPENBLAS",
    "VELOX_BLAS_ACTIVE",
    "VELOX_MLX_CUDA_INCLUDE",
    "VELOX_EMU_CACHE",
)


def _known(name: str) -> str:
    if name not in NAMES:
        raise ValueError(f"unknown velox environment variable {name!r}; known: {', '.join(NAMES)}")
    return name


def get(name: str) -> str | None:
    """The value of ``name`` (one of :data:`NAMES`), stripped; None where unset or empty."""
    raw = os.environ.get(_known(name), "").strip()
    return raw or None


def paths(name: str) -> list[Path]:
    """``name``'s colon-separated folders, ``~`` expanded, empty entries dropped."""
    return [Path(p).expanduser() for p in (get(name) or "").split(":") if p]


def put(name: str, value: str) -> None:
    """Set ``name`` in this process's environment (seen by the processes it starts)."""
    os.environ[_known(name)] = value


def with_setting(env: dict[str, str] | None = None, **settings: str) -> dict[str, str]:
    """A copy of ``env`` (default this process's environment) with ``settings`` set, for a
    process velox starts (names from :data:`NAMES`)."""
    out = dict(os.environ if env is None else env)
    for name, value in settings.items():
        out[_known(name)] = value
    return out


def shipped_dirs() -> list[Path]:
    """The folders of the artifacts that ship with velox (fitted for the project's reference
    models): ``artifacts/`` of ``$VELOX_SHARED``, of a ``shared/`` folder in the working
    directory or above it (a clone's root), and of the source checkout's ``shared/``; those
    that exist, each once."""
    here = Path.cwd().resolve()
    roots = [
        *paths("VELOX_SHARED"),
        *(p / "shared" for p in (here, *here.parents)),
        Path(__file__).resolve().parents[4] / "shared",  # a source checkout
    ]
    found: list[Path] = []
    for r in roots:
        d = r / "artifacts"
        if d.is_dir() and d not in found:
            found.append(d)
    return found


def search_dirs() -> list[Path]:
    """Where artifacts are looked up: ``$VELOX_ARTIFACTS`` (in order), then ``~/.cache/velox``,
    then the shipped artifacts (:func:`shipped_dirs`)."""
    return [*paths("VELOX_ARTIFACTS"), Path("~/.cache/velox").expanduser(), *shipped_dirs()]
