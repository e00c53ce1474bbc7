"""The full Metal source MLX compiles around a velox kernel body (a test aid).

:func:`metal_source` rebuilds what ``write_signature`` in MLX's ``custom_kernel.cpp`` writes
around a :class:`velox_core.kernels.build.KernelSpec`'s body: the signature with every input,
its shape, stride and rank arguments where the body names them, the outputs and the Metal
attribute arguments, and the template instantiation. No machine here runs Metal: the text is
compiled with ``g++`` through the C++ shim of Metal (:func:`velox_testing.compile_metal`) and
run by the CPU emulator (:mod:`velox_testing.emulate`). The CUDA twin, which velox-core's PTX
disk cache needs at run time, is :func:`velox_core.kernels.build.cuda_source`.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any

from velox_core.kernels.build import (
    _METAL_TYPES,
    ArgInfo,
    KernelSpec,
    _check_outputs,
    _dtype_name,
    _shape_infos,
)

__all__ = ["metal_attributes", "metal_source", "source_digest"]

# mlx/backend/common/metal_kernel.cpp, in MLX's order
_METAL_ATTRIBUTES = (
    ("dispatch_quadgroups_per_threadgroup", "uint"),
    ("dispatch_simdgroups_per_threadgroup", "uint"),
    ("dispatch_threads_per_threadgroup", "uint3"),
    ("grid_origin", "uint3"),
    ("grid_size", "uint3"),
    ("quadgroup_index_in_threadgroup", "uint"),
    ("quadgroups_per_threadgroup", "uint"),
    ("simdgroup_index_in_threadgroup", "uint"),
    ("simdgroups_per_threadgroup", "uint"),
    ("thread_execution_width", "uint"),
    ("thread_index_in_quadgroup", "uint"),
    ("thread_index_in_simdgroup", "uint"),
    ("thread_index_in_threadgroup", "uint"),
    ("thread_position_in_grid", "uint3"),
    ("thread_position_in_threadgroup", "uint3"),
    ("threadgroup_position_in_grid", "uint3"),
    ("threadgroups_per_grid", "uint3"),
    ("threads_per_grid", "uint3"),
    ("threads_per_simdgroup", "uint"),
    ("threads_per_threadgroup", "uint3"),
)
_MAX_CONSTANT_ARRAY_SIZE = 8  # MLX passes smaller inputs in the constant address space


def metal_attributes(body: str) -> list[tuple[str, str]]:
    """The attribute arguments MLX appends for ``body``, in signature order: (name, type)."""
    return [(n, t) for n, t in _METAL_ATTRIBUTES if n in body]


def _template_value(v: Any) -> str:
    if isinstance(v, bool):
        return str(int(v))
    if isinstance(v, int):
        return str(v)
    return _METAL_TYPES[_dtype_name(v)]


def metal_source(
    spec: KernelSpec,
    inputs: Sequence[ArgInfo],
    output_dtypes: Sequence[Any],
    template: Sequence[tuple[str, Any]] = (),
) -> tuple[str, str]:
    """The full Metal source MLX compiles for ``spec`` (``write_signature``), and the kernel name.

    The source starts with the header; MLX puts its own ``metal::utils()`` before it.
    """
    _check_outputs(spec, output_dtypes)
    body = spec.body("metal")
    infos = _shape_infos(body, spec.inputs)
    kname = "custom_kernel_" + spec.name
    if template:
        tdef = "<" + ", ".join(_template_value(v) for _, v in template) + ">"
        thash = tdef.replace(", ", "_").replace("<", "_").replace(">", "_")[:-1]
        kname += "_" + thash
    for a in inputs:
        kname += "_" + _METAL_TYPES[a.dtype]
        if a.ndim == 0:
            kname += "s"
        elif a.size < _MAX_CONSTANT_ARRAY_SIZE:
            kname += "c"
    for d in output_dtypes:
        kname += "_" + _METAL_TYPES[_dtype_name(d)]
    src = spec.header("metal")
    if template:
        params = []
        for name, v in template:
            kind = "bool" if isinstance(v, bool) else "int" if isinstance(v, int) else "typename"
            params.append(f"{kind} {name}")
        src += "template <" + ", ".join(params) + ">\n"
    src += f"[[kernel]] void {kname}(\n"
    args, index = [], 0
    for name, a, (sh, st, nd) in zip(spec.inputs, inputs, infos):
        loc = "constant" if a.size < _MAX_CONSTANT_ARRAY_SIZE else "device"
        ref = "&" if a.ndim == 0 else "*"
        args.append(f"  const {loc} {_METAL_TYPES[a.dtype]}{ref} {name} [[buffer({index})]]")
        index += 1
        if a.ndim > 0:
            if sh:
                args.append(f"  const constant int* {name}_shape [[buffer({index})]]")
                index += 1
            if st:
                args.append(f"  const constant int64_t* {name}_strides [[buffer({index})]]")
                index += 1
            if nd:
                args.append(f"  const constant int& {name}_ndim [[buffer({index})]]")
                index += 1
    for name, d in zip(spec.outputs, output_dtypes):
        args.append(f"  device {_METAL_TYPES[_dtype_name(d)]}* {name} [[buffer({index})]]")
        index += 1
    for attr, typ in metal_attributes(body):
        args.append(f"  {typ} {attr} [[{attr}]]")
    src += ",\n".join(args) + ") {\n" + body + "\n}\n"
    if template:
        tdef = kname + "<" + ", ".join(_template_value(v) for _, v in template) + ">"
        src += f'\ntemplate [[host_name("{kname}")]] [[kernel]] decltype({tdef}) {tdef};\n'
    return src, kname


def source_digest(text: str) -> str:
    """Short stable digest of a generated source (names temporary build files)."""
    return hashlib.sha1(text.encode()).hexdigest()[:12]
