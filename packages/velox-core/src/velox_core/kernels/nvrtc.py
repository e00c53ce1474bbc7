"""NVRTC through ctypes, with nothing but the standard library: a CUDA kernel compiled in this
process, or in a process of its own.

NVRTC compiles one program at a time within a process: four of velox's kernels take about as
long on four threads as one after another, and while they compile, the kernels MLX compiles
for the model's own first steps wait behind them. A compile in a worker process
(:func:`compile_in_worker`: ``python -I -S nvrtc.py``, the job on its stdin, the result on its
stdout) runs beside the others and beside MLX's, and the worker starts in tens of
milliseconds since it imports neither MLX nor velox. :mod:`velox_core.kernels.disk_cache`
works out the job (the source MLX would compile, MLX's options, the stand-in header) and
decides where it runs (``KernelConfig.compile_processes``).
"""

from __future__ import annotations

import base64
import ctypes
import json
import subprocess
import sys
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from typing import Any

__all__: list[str] = []

LIBRARIES = ("libnvrtc.so.13", "libnvrtc.so.12", "libnvrtc.so")
WORKER_SECONDS = 600  # a compile of velox's takes seconds; past this the worker is stuck


def load(extra: Iterable[str] = ()) -> tuple[Any, str]:
    """The first NVRTC library that loads (by soname, then the ``extra`` paths), and its
    name."""
    for name in (*LIBRARIES, *extra):
        try:
            lib = ctypes.CDLL(name)
        except OSError:
            continue
        lib.nvrtcGetErrorString.restype = ctypes.c_char_p
        return lib, name
    raise OSError("no NVRTC library found (libnvrtc.so.13 or .12)")


def version(lib: Any) -> tuple[int, int]:
    major, minor = ctypes.c_int(), ctypes.c_int()
    _check(lib, lib.nvrtcVersion(ctypes.byref(major), ctypes.byref(minor)), "nvrtcVersion")
    return major.value, minor.value


def _check(lib: Any, result: int, what: str) -> None:
    if result != 0:
        raise RuntimeError(f"{what}: {lib.nvrtcGetErrorString(result).decode()}")


@dataclass(frozen=True)
class Job:
    """One compile: ``source`` (as ``file_name``) with ``options`` and the in-memory
    ``headers`` (include name -> text), the mangled name of ``kernel`` looked up, the cubin
    kept (PTX where ``cubin`` is False)."""

    source: str
    kernel: str
    file_name: str
    options: tuple[str, ...]
    headers: dict[str, bytes]
    cubin: bool


def compile_program(lib: Any, job: Job) -> tuple[bytes, str]:
    """``job`` compiled with ``lib``: (the cubin or PTX, the mangled name of its kernel)."""
    source, kernel, file_name, options, headers = (
        job.source, job.kernel, job.file_name, job.options, job.headers,
    )  # fmt: skip
    prog = ctypes.c_void_p()
    texts = (ctypes.c_char_p * len(headers))(*headers.values())
    names = (ctypes.c_char_p * len(headers))(*(n.encode() for n in headers))
    _check(
        lib,
        lib.nvrtcCreateProgram(
            ctypes.byref(prog), source.encode(), file_name.encode(), len(headers), texts, names
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
            if job.cubin
            else (lib.nvrtcGetPTXSize, lib.nvrtcGetPTX)
        )
        _check(lib, get_size(prog, ctypes.byref(size)), "nvrtcGet(CUBIN|PTX)Size")
        buf = ctypes.create_string_buffer(size.value)
        _check(lib, get(prog, buf), "nvrtcGet(CUBIN|PTX)")
        return buf.raw, lowered
    finally:
        lib.nvrtcDestroyProgram(ctypes.byref(prog))


def compile_in_worker(library: str, job: Job) -> tuple[bytes, str]:
    """:func:`compile_program` of ``job`` in a process of its own (``library``: the NVRTC to
    load there). Raises ``RuntimeError`` with the worker's message where it fails."""
    fields = asdict(job)
    fields["headers"] = {n: base64.b64encode(t).decode() for n, t in job.headers.items()}
    fields["options"] = list(job.options)
    run = subprocess.run(
        [sys.executable, "-I", "-S", __file__],
        input=json.dumps({"library": library, "job": fields}).encode(),
        capture_output=True,
        timeout=WORKER_SECONDS,
        check=False,
    )
    if run.returncode != 0:
        message = run.stderr.decode(errors="replace").strip() or "no message"
        raise RuntimeError(
            f"the NVRTC worker for {job.kernel} failed ({run.returncode}): {message}"
        )
    out = json.loads(run.stdout)
    return base64.b64decode(out["binary"]), out["mangled"]


def main() -> int:
    """A worker: one job (JSON on stdin, as :func:`compile_in_worker` writes it), its result
    (JSON on stdout: the binary in base64, the mangled name); errors on stderr, status 1."""
    try:
        given = json.load(sys.stdin)
        lib = ctypes.CDLL(given["library"])
        lib.nvrtcGetErrorString.restype = ctypes.c_char_p
        fields = given["job"]
        fields["headers"] = {n: base64.b64decode(t) for n, t in fields["headers"].items()}
        fields["options"] = tuple(fields["options"])
        binary, mangled = compile_program(lib, Job(**fields))
    except Exception as e:  # the parent reports it (and turns the disk cache off)
        print(f"{type(e).__name__}: {e}", file=sys.stderr)
        return 1
    json.dump({"binary": base64.b64encode(binary).decode(), "mangled": mangled}, sys.stdout)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
