"""Building the kernel emulator's program: one ``g++`` call per kernel source, cached.

A program is kept under ``emu_<tag>`` in a folder: the emulator's workdir, keyed by its
source, or, where ``VELOX_EMU_CACHE`` names a folder (the test sessions of one CI run share
one), keyed by everything it is built from: the source, the compiler's flags and the shim
headers' text. It is built under a fresh name and renamed, so processes sharing the folder
never run a half-written program.
"""

from __future__ import annotations

import os
import secrets
import shutil
import subprocess
from pathlib import Path

from velox_core import environment

from .metal_source import source_digest

__all__ = ["CACHE_ENV", "build_program", "compiler"]

# a folder the emulator's binaries are kept in across processes (the test sessions of one CI
# run share one), keyed by their source, compiler flags and shim headers; unset: per workdir
CACHE_ENV = "VELOX_EMU_CACHE"


def compiler() -> str | None:
    """The C++ compiler to use (``$CXX`` or ``g++``), or None when there is none."""
    cxx = os.environ.get("CXX", "g++")
    return shutil.which(cxx)


def _headers_text(dirs: list[Path]) -> str:
    """The shim headers' text (a change to them builds every binary again)."""
    return "\0".join(f.read_text() for d in dirs for f in sorted(d.rglob("*")) if f.is_file())


def build_program(source: str, opt: str, include_dirs: list[Path], workdir: Path) -> Path:
    """The compiled program of ``source`` (C++17, ``opt``, the ``include_dirs``), built now
    unless the cache holds it; raises with the compiler's output on failure."""
    cxx = compiler()
    if cxx is None:
        raise FileNotFoundError("no C++ compiler (g++ or $CXX) for the kernel emulator")
    cmd = [cxx, "-std=c++17", opt, "-pthread", "-w"]
    cmd += [a for d in include_dirs for a in ("-I", str(d))]
    shared = environment.get(CACHE_ENV)
    if shared:  # keyed by everything the binary is built from, headers included
        folder = Path(shared)
        tag = source_digest("\0".join([source, *cmd, _headers_text(include_dirs)]))
    else:
        folder, tag = workdir, source_digest(source)
    folder.mkdir(parents=True, exist_ok=True)
    exe = folder / f"emu_{tag}"
    if not exe.exists():
        part = f"emu_{tag}.{os.getpid()}-{secrets.token_hex(4)}"
        cpp, out = folder / f"{part}.cpp", folder / f"{part}.exe"
        cpp.write_text(source)
        try:
            res = subprocess.run(
                [*cmd, "-o", str(out), str(cpp)], capture_output=True, text=True, check=False
            )
            if res.returncode != 0:
                raise RuntimeError(f"emulator compile failed:\n{res.stderr[-6000:]}")
            os.replace(out, exe)
        finally:
            cpp.unlink(missing_ok=True)
            out.unlink(missing_ok=True)
    return exe
