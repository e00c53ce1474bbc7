"""Kernel assembly: one body, instantiated for ``mx.fast.metal_kernel`` or ``mx.fast.cuda_kernel``.

A velox kernel is a body file in the repository's ``metal/`` folder (``*.metal``), written once
against the small portability layer ``velox_kernels.h``. :class:`KernelSpec` turns it into
the arguments MLX takes for each backend: the header (``#define VX_METAL`` or ``VX_CUDA`` and
the layer) and the body (a backend prologue that names the launch indices, then the file).

:func:`cuda_source` rebuilds the complete source MLX generates around a body for CUDA (the
kernel ``build_kernel`` writes in MLX's ``custom_kernel.cpp``): the PTX disk cache compiles it
(:mod:`velox_core.kernels.disk_cache`), and CI compiles it with ``nvcc`` on a machine without a
GPU. The Metal twin, a test aid, is :func:`velox_testing.metal_source.metal_source`.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx

from . import get_kernel, kernel_source
from .config import kernel_config
from .disk_cache import wrap, write_whole

__all__ = ["ArgInfo", "KernelSpec", "cuda_source"]

# The launch indices every body uses, as each backend spells them. Metal's names must appear
# literally in the body: MLX adds an attribute argument only for names found in the source.
PROLOGUE = {
    "metal": (
        "  const int vx_tid = (int)thread_index_in_threadgroup;\n"
        "  const int vx_ntg = (int)threads_per_threadgroup.x;\n"
        "  const int vx_gx = (int)threadgroup_position_in_grid.x;\n"
        "  const int vx_gy = (int)threadgroup_position_in_grid.y;\n"
        "  const int vx_gz = (int)threadgroup_position_in_grid.z;\n"
        "  const int vx_ngx = (int)threadgroups_per_grid.x;\n"
        "  const int vx_global_x = (int)thread_position_in_grid.x;\n"
    ),
    "cuda": (
        "  const int vx_tid = (int)threadIdx.x;\n"
        "  const int vx_ntg = (int)blockDim.x;\n"
        "  const int vx_gx = (int)blockIdx.x;\n"
        "  const int vx_gy = (int)blockIdx.y;\n"
        "  const int vx_gz = (int)blockIdx.z;\n"
        "  const int vx_ngx = (int)gridDim.x;\n"
        "  const int vx_global_x = (int)(blockIdx.x * blockDim.x + threadIdx.x);\n"
    ),
}
_SILENCE = (
    "  (void)vx_tid; (void)vx_ntg; (void)vx_gx; (void)vx_gy; (void)vx_gz; (void)vx_ngx;\n"
    "  (void)vx_global_x;\n"
)


def compact(text: str) -> str:
    """``text`` without comments, indentation and blank lines (same tokens, same lines for
    the preprocessor). MLX hashes a custom kernel's whole source on every evaluation and
    copies it on every call: the sources' comments would cost about 0.2 microseconds per
    1,000 characters and call on an H200 host (``benchmarks/gpu_dispatch.py``)."""
    out: list[str] = []
    i, n = 0, len(text)
    while i < n:
        c = text[i]
        if c == '"' or c == "'":  # a literal, kept whole (escapes included)
            j = i + 1
            while j < n and text[j] != c:
                j += 2 if text[j] == "\\" else 1
            out.append(text[i : j + 1])
            i = j + 1
        elif text.startswith("//", i):
            j = text.find("\n", i)
            i = n if j < 0 else j
        elif text.startswith("/*", i):
            j = text.find("*/", i + 2)
            i = n if j < 0 else j + 2
            out.append(" ")
        else:
            j = i + 1
            while j < n and text[j] not in "\"'/":
                j += 1
            if j < n and text[j] == "/" and not text.startswith(("//", "/*"), j):
                j += 1
            out.append(text[i:j])
            i = j
    lines = (line.strip() for line in "".join(out).split("\n"))
    return "".join(line + "\n" for line in lines if line)


@dataclass(frozen=True)
class KernelSpec:
    """A kernel body and its argument names.

    Args:
        name: MLX kernel name (also the cache key of :func:`velox_core.kernels.get_kernel`).
        source: body file name in ``metal/`` (shipped in the wheel's ``kernels/src``).
        inputs: input argument names, in call order.
        outputs: output argument names, in call order.
        row_contiguous: ask MLX to copy non-contiguous inputs (False: the body reads strides).
        package: the package whose wheel ships the source.
        cuda_headers: extra header files (in ``metal/``) placed after the layer for CUDA only
            (a CUDA-only body: ``velox_mma.cuh`` for tensor-core fragments).
        cuda_launch_bounds: ``(threads, blocks)``: the CUDA kernel is declared with
            ``__launch_bounds__(threads, blocks)``, which caps its registers so that ``blocks``
            threadgroups of ``threads`` fit on one SM. MLX writes the kernel's declaration
            itself, so the header re-defines ``__global__`` to carry the bounds (NVRTC and
            nvcc define it as a macro; the CPU emulation ignores it). Specs with different
            bounds need different names: MLX caches compiled kernels by name.
        defines: macros defined at the top of the header (``"NAME VALUE"``), for a body whose
            variants differ in what MLX declares (an output present in one spec only).
        inserts: ``(marker, file, package)``: the body with each ``marker`` line replaced by
            the text of ``file`` shipped by ``package`` (a layout's key pass in the portable
            decode kernel, :func:`velox_core.kernels.portable.decode_spec`).
    """

    name: str
    source: str
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    row_contiguous: bool = True
    package: str = "velox_core"
    cuda_headers: tuple[str, ...] = ()
    cuda_launch_bounds: tuple[int, int] | None = None
    defines: tuple[str, ...] = ()
    inserts: tuple[tuple[str, str, str], ...] = ()

    def header(self, backend: str) -> str:
        if backend not in PROLOGUE:
            raise ValueError(f"kernel backend must be 'metal' or 'cuda', got {backend!r}")
        text = f"#define VX_{backend.upper()} 1\n"
        text += "".join(f"#define {d}\n" for d in self.defines)
        text += compact(kernel_source("velox_kernels.h"))
        if backend == "cuda":
            for name in self.cuda_headers:
                text += "\n" + compact(kernel_source(name))
            if self.cuda_launch_bounds is not None:
                bounds = "__launch_bounds__({}, {})".format(*self.cuda_launch_bounds)
                text += (
                    "\n#if defined(__global__) && !defined(VX_CUDA_EMULATE)\n#undef __global__\n"
                    f"#define __global__ __location__(global) {bounds}\n"
                    "#endif\n"
                )
        return text

    def body(self, backend: str) -> str:
        if backend not in PROLOGUE:
            raise ValueError(f"kernel backend must be 'metal' or 'cuda', got {backend!r}")
        text = kernel_source(self.source, self.package)
        for marker, name, package in self.inserts:
            if text.count(marker) != 1:
                raise ValueError(f"{self.source}: expected one {marker!r} line for {name}")
            text = text.replace(marker, kernel_source(name, package))
        return PROLOGUE[backend] + _SILENCE + compact(text)

    def mlx_texts(self, backend: str) -> tuple[str, str]:
        """(header, body) as handed to MLX: the texts themselves, or on CUDA (with
        ``KernelConfig.cuda_include``, the default) two ``#include`` lines of files holding
        them, in ``$XDG_CACHE_HOME`` (or ``~/.cache``) ``/velox/cuda-src``.

        MLX copies a custom kernel's header and body into every call's source and hashes that
        source on every evaluation (``CustomKernel``): host time per call that grows with the
        text, 43,000 characters for the tensor-core kernel, in every layer of every step.
        Included by absolute path, the texts reach NVRTC whole while MLX handles two short
        lines. The files are named by their content's digest, so a changed text is a new
        name (and a new module for MLX's caches). The body's line keeps the names of the
        shape, stride and rank arguments it uses in a comment: MLX declares those arguments
        for the names it finds in the body text. Without a writable folder, the texts.
        """
        header, body = self.header(backend), self.body(backend)
        if backend != "cuda" or not kernel_config().cuda_include:
            return header, body
        used = [
            f"{n}_{w}"
            for n in self.inputs
            for w in ("shape", "strides", "ndim")
            if f"{n}_{w}" in body
        ]
        inner = body.removeprefix(PROLOGUE["cuda"] + _SILENCE)
        note = f"  // uses {' '.join(used)}\n" if used else ""
        try:
            head_file, body_file = _text_file(header, ".cuh"), _text_file(inner, ".inc")
        except OSError:  # no writable cache folder: MLX takes the texts themselves
            return header, body
        return (
            f'#include "{head_file}"\n',
            PROLOGUE["cuda"] + _SILENCE + note + f'#include "{body_file}"\n',
        )

    def build(self, backend: str) -> Any:
        """The MLX kernel object for ``backend`` (call it with inputs, grid, template...)."""
        header, body = self.mlx_texts(backend)
        common = {
            "name": self.name,
            "input_names": list(self.inputs),
            "output_names": list(self.outputs),
            "source": body,
            "header": header,
            "ensure_row_contiguous": self.row_contiguous,
        }
        if backend == "metal":
            return mx.fast.metal_kernel(**common)
        if backend == "cuda":
            return wrap(mx.fast.cuda_kernel(**common), self.mlx_source)
        raise ValueError(f"no kernel build for backend {backend!r}")

    def mlx_source(
        self, inputs: Sequence[Any], output_dtypes: Sequence[Any], template: Sequence[Any] = ()
    ) -> tuple[str, str]:
        """The full CUDA source MLX generates for a call with these arguments, and the
        kernel's name (:func:`cuda_source` of :meth:`mlx_texts`)."""
        infos = [ArgInfo.of(a) for a in inputs]
        return cuda_source(self, infos, output_dtypes, template, self.mlx_texts("cuda"))

    def kernel(self) -> Any:
        """The kernel for the current backend, built once per process."""
        return get_kernel(self.name, self.build)


# -- what MLX generates around a body (CUDA here; Metal: velox_testing.metal_source) --------------

_METAL_TYPES = {
    "float32": "float",
    "float16": "float16_t",
    "bfloat16": "bfloat16_t",
    "uint32": "uint32_t",
    "int32": "int32_t",
    "uint8": "uint8_t",
    "uint16": "uint16_t",
    "int64": "int64_t",
    "bool": "bool",
}
# the Metal names but for the half types
_CUDA_TYPES = {**_METAL_TYPES, "float16": "__half", "bfloat16": "__nv_bfloat16"}


@dataclass(frozen=True)
class ArgInfo:
    """What MLX's code generator sees of one input: dtype name, rank and size."""

    dtype: str
    ndim: int
    size: int

    @staticmethod
    def of(a: Any) -> ArgInfo:
        """From an ``mx.array`` or a numpy array."""
        name = str(a.dtype).replace("mlx.core.", "")
        return ArgInfo(name, len(a.shape), int(a.size))


def _dtype_name(d: Any) -> str:
    return str(d).replace("mlx.core.", "")


def _shape_infos(body: str, names: Sequence[str]) -> list[tuple[bool, bool, bool]]:
    return [(f"{n}_shape" in body, f"{n}_strides" in body, f"{n}_ndim" in body) for n in names]


def _check_outputs(spec: KernelSpec, output_dtypes: Sequence[Any]) -> None:
    """One dtype per output the spec declares, as MLX requires of a launch."""
    if len(output_dtypes) != len(spec.outputs):
        raise ValueError(
            f"{spec.name}: {len(output_dtypes)} output dtypes for the outputs {spec.outputs}"
        )


_CUDA_DEFAULT_HEADER = """
#include "mlx/backend/cuda/device/utils.cuh"

#include <cooperative_groups.h>

"""


def cuda_source(
    spec: KernelSpec,
    inputs: Sequence[ArgInfo],
    output_dtypes: Sequence[Any],
    template: Sequence[tuple[str, Any]] = (),
    texts: tuple[str, str] | None = None,
) -> tuple[str, str]:
    """The full CUDA source MLX compiles with NVRTC for ``spec`` (``build_kernel``), and the
    kernel name. ``texts``: the (header, body) handed to MLX (:meth:`KernelSpec.mlx_texts`;
    default the spec's full texts)."""
    _check_outputs(spec, output_dtypes)
    header, body = texts if texts is not None else (spec.header("cuda"), spec.body("cuda"))
    infos = _shape_infos(body, spec.inputs)
    thash = ""
    for _, v in template:
        if isinstance(v, bool):
            thash += "_t" if v else "_f"
        elif isinstance(v, int):
            thash += f"_{v}"
        else:
            thash += "_" + _METAL_TYPES[_dtype_name(v)]
    kname = "custom_kernel_" + spec.name + thash
    src = _CUDA_DEFAULT_HEADER + header
    src += "namespace mlx::core::cu {\n\nnamespace cg = cooperative_groups;\n\n"
    src += f"__global__ void {kname}(\n"
    parts = []
    for name, a, (sh, st, nd) in zip(spec.inputs, inputs, infos):
        parts.append(f"    const {_CUDA_TYPES[a.dtype]}* {name}")
        if a.ndim > 0:
            if sh:
                parts.append(f"    const __grid_constant__ Shape {name}_shape")
            if st:
                parts.append(f"    const __grid_constant__ Strides {name}_strides")
            if nd:
                parts.append(f"    const __grid_constant__ int {name}_ndim")
    for name, d in zip(spec.outputs, output_dtypes):
        parts.append(f"    {_CUDA_TYPES[_dtype_name(d)]}* {name}")
    src += ",\n".join(parts) + ") {\n"
    for name, v in template:
        if isinstance(v, bool):
            src += f"  constexpr bool {name} = {'true' if v else 'false'};\n"
        elif isinstance(v, int):
            src += f"  constexpr int {name} = {v};\n"
        else:
            src += f"  using {name} = {_CUDA_TYPES[_dtype_name(v)]};\n"
    if template:
        src += "\n"
    src += body + "\n}\n\n} // namespace mlx::core::cu\n"
    return src, kname


def _text_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "velox" / "cuda-src"


def _text_file(text: str, suffix: str) -> Path:
    """``text`` in a file named by its digest (written once, whole, by a rename)."""
    path = _text_dir() / (hashlib.sha256(text.encode()).hexdigest()[:24] + suffix)
    if not path.exists() or path.read_text() != text:
        write_whole(path, text.encode())
    return path
