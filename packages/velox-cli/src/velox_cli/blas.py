"""A fast BLAS for MLX's Linux CPU wheel, preloaded by the ``velox`` command.

MLX's Linux CPU wheel (``mlx-cpu``) links a bundled reference BLAS (netlib's, in
``mlx_cpu.libs/libblas-*.so``) for its float32 matrix products: about 2 GFLOP/s on one x86
core, against 50-70 with OpenBLAS, which makes ``velox bench`` 10-15 times slower. MLX looks
``cblas_sgemm`` up in the process's global scope before its own libraries, so an OpenBLAS
named in ``LD_PRELOAD`` replaces the reference one; ``LD_PRELOAD`` is read when a process
starts, so :func:`preload` re-executes the command once with it set and prints one line
saying so (on stderr). OpenBLAS runs one thread unless ``OPENBLAS_NUM_THREADS`` says otherwise.

Where the library comes from, first found:

1. ``VELOX_BLAS=PATH``: that library (it must export ``cblas_sgemm``);
2. the ``ngsolve-openblas`` wheel (OpenBLAS built with ``DYNAMIC_ARCH``, a dependency of
   velox-cli on Linux x86_64). It needs ``libgfortran.so.5``, which a machine with only
   Python lacks, and looks for it first in its own directory (``RPATH $ORIGIN``): it is
   loaded through a directory of symbolic links (under ``~/.cache/velox/blas``) that places
   it beside MLX's own bundled ``libgfortran`` and ``libquadmath``;
3. Debian's or Ubuntu's OpenBLAS (``apt-get install libopenblas0-pthread``).

``VELOX_BLAS=off`` keeps MLX's own BLAS. Nothing happens off Linux, where MLX does not bundle
the reference BLAS (a build of MLX linked with another BLAS, a Mac), or when ``LD_PRELOAD``
already names a BLAS. :func:`active_blas` names the library that serves ``cblas_sgemm`` in
this process (``velox bench`` records it with its results).
"""

from __future__ import annotations

import ctypes
import hashlib
import importlib.metadata as metadata
import os
import sys
import tempfile
from pathlib import Path

from velox_core import environment

__all__ = ["active_blas", "find_blas", "preload"]

OFF = ("off", "0", "no", "none", "false")
DEBIAN = (
    "/usr/lib/x86_64-linux-gnu/libopenblas.so.0",
    "/usr/lib/aarch64-linux-gnu/libopenblas.so.0",
)
ACTIVE = "VELOX_BLAS_ACTIVE"  # set in the re-executed process: the library preloaded


def _dist_files(dist: str, pattern: str) -> list[Path]:
    """Files of an installed distribution whose name matches ``pattern`` (glob), or []."""
    try:
        files = metadata.files(dist) or []
    except metadata.PackageNotFoundError:
        return []
    out = []
    for f in files:
        if Path(f.name).match(pattern):
            p = Path(f.locate())
            if p.is_file():
                out.append(p)
    return sorted(out)


def mlx_reference_blas() -> Path | None:
    """MLX's bundled reference BLAS (the ``mlx-cpu`` wheel's), or None when MLX has none."""
    found = _dist_files("mlx-cpu", "libblas*.so*")
    return found[0] if found else None


def _link_dir(lib: Path) -> Path | None:
    """A directory holding ``libopenblas.so.0`` -> ``lib`` and, beside it, links to MLX's
    bundled Fortran runtime (``libgfortran.so.5`` and the libraries it needs under their own
    names), so that ``lib``'s ``RPATH $ORIGIN`` finds them; None when MLX bundles none."""
    runtime = _dist_files("mlx-cpu", "libgfortran*.so*") + _dist_files(
        "mlx-cpu", "libquadmath*.so*"
    )
    gfortran = [p for p in runtime if p.name.startswith("libgfortran")]
    if not gfortran:
        return None
    links = {"libopenblas.so.0": lib, "libgfortran.so.5": gfortran[0]}
    links.update({p.name: p for p in runtime})
    key = hashlib.sha256(repr(sorted((k, str(v)) for k, v in links.items())).encode())
    name = "blas-" + key.hexdigest()[:16]
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "velox"
    for root in (cache, Path(tempfile.gettempdir()) / f"velox-{os.getuid()}"):
        d = root / name
        try:
            d.mkdir(parents=True, exist_ok=True)
            for k, v in links.items():
                p = d / k
                if not (p.is_symlink() and os.readlink(p) == str(v)):
                    tmp = d / f".{k}.{os.getpid()}"
                    tmp.unlink(missing_ok=True)
                    tmp.symlink_to(v)
                    os.replace(tmp, p)  # atomic: a concurrent run sees the old or new link
            return d
        except OSError:
            continue
    return None


def _loads(path: Path) -> str | None:
    """None if ``path`` loads and exports ``cblas_sgemm``, else why not (one line)."""
    try:
        lib = ctypes.CDLL(str(path))
    except OSError as e:
        return str(e).strip().splitlines()[0]
    if not hasattr(lib, "cblas_sgemm"):
        return f"{path} exports no cblas_sgemm"
    return None


def find_blas() -> tuple[Path | None, str, list[str]]:
    """The library to preload, a short description of it, and why candidates were skipped.

    Returns ``(None, "", reasons)`` when none can be loaded.
    """
    reasons: list[str] = []
    env = environment.get("VELOX_BLAS")
    if env:
        p = Path(env).expanduser()
        why = _loads(p) if p.is_file() else f"VELOX_BLAS={env}: no such file"
        if why is None:
            return p, f"{p.name} (VELOX_BLAS)", reasons
        reasons.append(why)
        return None, "", reasons
    for lib in _dist_files("ngsolve-openblas", "libopenblas*.so*"):
        d = _link_dir(lib)
        p = lib if d is None else d / "libopenblas.so.0"
        why = _loads(p)
        if why is None:
            return p, f"OpenBLAS from the ngsolve-openblas wheel ({lib.name})", reasons
        reasons.append(f"ngsolve-openblas: {why}")
    for deb in DEBIAN:
        p = Path(deb)
        if p.exists():
            why = _loads(p)
            if why is None:
                return p, f"the system's OpenBLAS ({deb})", reasons
            reasons.append(f"{deb}: {why}")
    return None, "", reasons


def preload(argv: list[str]) -> None:
    """Re-execute ``python -m velox_cli argv`` with a fast BLAS preloaded, once, when MLX would
    otherwise compute with its bundled reference BLAS; print one line saying what it does (or
    why it cannot). Returns only when it does not re-execute."""
    setting = (environment.get("VELOX_BLAS") or "").lower()
    if (
        sys.platform != "linux"
        or setting in OFF
        or environment.get("VELOX_NO_OPENBLAS")  # the earlier opt-out, still honoured
        or environment.get(ACTIVE)
        or "blas" in os.environ.get("LD_PRELOAD", "").lower()
        or mlx_reference_blas() is None
    ):
        return
    lib, what, reasons = find_blas()
    if lib is None:
        why = f" ({'; '.join(reasons)})" if reasons else ""
        print(
            "velox: MLX computes with its bundled reference BLAS, 10-15x slower than OpenBLAS"
            f"{why}: pip install ngsolve-openblas, apt-get install libopenblas0-pthread, or "
            "VELOX_BLAS=PATH to a library exporting cblas_sgemm",
            file=sys.stderr,
        )
        return
    threads = os.environ.get("OPENBLAS_NUM_THREADS") or "1"
    print(
        f"velox: preloading {what}, {threads} thread(s), in place of MLX's bundled reference "
        "BLAS (VELOX_BLAS=off keeps MLX's own)",
        file=sys.stderr,
        flush=True,
    )
    pre = os.environ.get("LD_PRELOAD", "")
    env = environment.with_setting(**{ACTIVE: str(lib)})
    env["LD_PRELOAD"] = f"{lib}:{pre}" if pre else str(lib)
    # one BLAS thread unless asked otherwise: MLX runs its CPU ops on a thread of its own
    # beside Python's, its products here are small (512-token chunks), and a second OpenBLAS
    # thread spinning between them took CPU from both (on 2 cores, 3 specs of velox bench
    # took 2.2x the wall time with 2 threads)
    env["OPENBLAS_NUM_THREADS"] = threads
    os.execve(sys.executable, [sys.executable, "-m", "velox_cli", *argv], env)


def active_blas() -> str:
    """The library that serves MLX's ``cblas_sgemm`` in this process, as ``name (path)``;
    MLX's bundled reference BLAS when none is in the global scope."""

    class _DlInfo(ctypes.Structure):
        _fields_ = [
            ("dli_fname", ctypes.c_char_p),
            ("dli_fbase", ctypes.c_void_p),
            ("dli_sname", ctypes.c_char_p),
            ("dli_saddr", ctypes.c_void_p),
        ]

    ref = mlx_reference_blas()
    default = "MLX's bundled reference BLAS" if ref is not None else "MLX's own BLAS"
    try:
        glob = ctypes.CDLL(None)
        fn = glob.cblas_sgemm
    except (OSError, AttributeError):
        return default
    path = ""
    try:
        info = _DlInfo()
        if glob.dladdr(ctypes.cast(fn, ctypes.c_void_p), ctypes.byref(info)):
            path = (info.dli_fname or b"").decode(errors="replace")
    except AttributeError:
        path = environment.get(ACTIVE) or ""
    if ref is not None and path and os.path.realpath(path) == os.path.realpath(ref):
        return default
    name = "a preloaded BLAS"
    try:
        cfg = glob.openblas_get_config
        cfg.restype = ctypes.c_char_p
        name = " ".join(cfg().decode().split()[:2])  # "OpenBLAS 0.3.33"
    except AttributeError:
        pass
    return f"{name} ({path})" if path else name
