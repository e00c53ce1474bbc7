"""The C++ scaffolding of the kernel emulator's programs, and the files they exchange.

:mod:`velox_testing.emulate` compiles registered kernels into one CPU program; this module
holds the text around the kernels: the C++ types of each MLX dtype (Metal shim and CUDA
emulation), the Metal thread-position attributes as the shim's ids, the program's file I/O
helpers and the start of its ``main``, each case's lines that load the inputs, allocate and
fill the outputs and save them, and :func:`write_input`, which writes an input in the layout
the program reads (raw bytes, and a ``.meta`` of ndim, shape and strides in elements).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

__all__ = [
    "CUDA_TYPES",
    "CXX_TYPES",
    "IO_HELPERS",
    "METAL_IDS",
    "NP_TYPES",
    "case_arguments",
    "case_saves",
    "scoped_source",
    "write_input",
]

# each MLX dtype's C++ type in the Metal shim (CXX_TYPES) and in the CUDA emulation
# (CUDA_TYPES), and the numpy dtype its outputs are read as (bfloat16 as uint16 bit patterns)
CXX_TYPES = {
    "float32": "float",
    "float16": "half",
    "bfloat16": "bfloat16_t",
    "uint32": "uint32_t",
    "int32": "int32_t",
    "uint16": "uint16_t",
    "uint8": "uint8_t",
}
NP_TYPES = {
    "float32": np.float32,
    "float16": np.float16,
    "bfloat16": np.uint16,
    "uint32": np.uint32,
    "int32": np.int32,
    "uint16": np.uint16,
    "uint8": np.uint8,
}
CUDA_TYPES = {
    "float32": "float",
    "float16": "__half",
    "bfloat16": "__nv_bfloat16",
    "uint32": "uint32_t",
    "int32": "int32_t",
    "uint16": "uint16_t",
    "uint8": "uint8_t",
}
# each Metal thread-position attribute as an expression over the shim's ``vx_emu::Ids``
METAL_IDS = {
    "thread_index_in_threadgroup": "id.tid",
    "threads_per_threadgroup": "id.tg_size",
    "threadgroup_position_in_grid": "id.group",
    "threadgroups_per_grid": "id.groups",
    "thread_position_in_grid": "uint3{id.group.x * id.tg_size.x + id.tid, id.group.y, id.group.z}",
    "thread_index_in_simdgroup": "(id.tid & 31u)",
    "simdgroup_index_in_threadgroup": "(id.tid >> 5)",
}


def write_input(path: Path, arr: np.ndarray) -> None:
    """``arr`` as the program reads an input: ``path.bin`` holds the elements its strides
    reach (a view stays a view), ``path.meta`` its ndim, shape and strides in elements."""
    item = arr.itemsize
    if any(s < 0 for s in arr.strides) or any(s % item for s in arr.strides):
        arr = np.ascontiguousarray(arr)
    strides = [s // item for s in arr.strides]
    span = 0 if arr.size == 0 else 1 + sum((n - 1) * s for n, s in zip(arr.shape, strides))
    flat = np.lib.stride_tricks.as_strided(arr, shape=(span,), strides=(item,))
    path.with_suffix(".bin").write_bytes(flat.tobytes())
    meta = [arr.ndim, *arr.shape, *strides]
    path.with_suffix(".meta").write_text(" ".join(str(v) for v in meta))


# file I/O of the emulator programs: inputs (raw bytes + a .meta of ndim, shape, strides in
# elements), outputs, and the start of main (the kernel's index on the command line)
IO_HELPERS = [
    "#include <cstring>",
    "#include <fstream>",
    "#include <sstream>",
    "#include <string>",
    "template <typename T> static std::vector<T> vx_load(const std::string& p) {",
    "  std::ifstream f(p, std::ios::binary); std::stringstream ss; ss << f.rdbuf();",
    "  std::string s = ss.str(); std::vector<T> v(s.size() / sizeof(T) + 1);",
    "  std::memcpy((void*)v.data(), s.data(), s.size()); return v; }",
    "static void vx_meta(const std::string& p, std::vector<int>& sh, std::vector<int64_t>& st) {",
    "  std::ifstream f(p); int nd; f >> nd;",
    "  sh.resize(nd > 0 ? nd : 1); st.resize(nd > 0 ? nd : 1);",
    "  for (int i = 0; i < nd; ++i) f >> sh[i]; for (int i = 0; i < nd; ++i) f >> st[i]; }",
    "template <typename T> static void vx_save(const std::string& p, const std::vector<T>& v) {",
    "  std::ofstream f(p, std::ios::binary); "
    "f.write(reinterpret_cast<const char*>(v.data()), v.size() * sizeof(T)); }",
    "int main(int argc, char** argv) {",
    "  if (argc < 3) return 2;",
    "  const std::string dir = argv[1];",
    "  const int which = std::atoi(argv[2]);",
    '  std::ifstream lf(dir + "/launch.meta");',
]


def case_arguments(k, used, types: dict[str, str], cuda: bool) -> tuple[list[str], list[str]]:
    """Lines of an emulator case that load every input and allocate every output, and the
    kernel call's arguments (shapes and strides as pointers for Metal, as MLX's
    ``Shape`` / ``Strides`` arrays for CUDA)."""
    lines, call = [], []
    for i, (info, (sh, st, nd)) in enumerate(zip(k.infos, used)):
        lines.append(f'    auto in{i} = vx_load<{types[info.dtype]}>(dir + "/in{i}.bin");')
        lines.append(f"    std::vector<int> in{i}_sh; std::vector<int64_t> in{i}_st;")
        lines.append(f'    vx_meta(dir + "/in{i}.meta", in{i}_sh, in{i}_st);')
        shape, strides = f"in{i}_sh.data()", f"in{i}_st.data()"
        if cuda:
            lines.append(
                f"    mlx::core::cu::Shape a{i}_sh{{}}; mlx::core::cu::Strides a{i}_st{{}};"
            )
            lines.append(
                f"    for (size_t j = 0; j < in{i}_sh.size(); ++j) "
                f"{{ a{i}_sh[j] = in{i}_sh[j]; a{i}_st[j] = in{i}_st[j]; }}"
            )
            shape, strides = f"a{i}_sh", f"a{i}_st"
        call.append(f"in{i}.data()")
        if info.ndim > 0:
            call += [shape] if sh else []
            call += [strides] if st else []
            call += [f"(int)in{i}_sh.size()"] if nd else []
    for i, d in enumerate(k.dnames):
        lines.append(f"    size_t n{i}; lf >> n{i}; std::vector<{types[d]}> out{i}(n{i});")
        call.append(f"out{i}.data()")
    # every output byte set to the launch's fill byte: 0 as MLX's init_value=0 zeroes them,
    # 255 standing for the uninitialized memory a launch without init_value gets
    lines.append("    int vx_fill; lf >> vx_fill;")
    for i, d in enumerate(k.dnames):
        lines.append(f"    std::memset((void*)out{i}.data(), vx_fill, n{i} * sizeof({types[d]}));")
    return lines, call


def case_saves(k) -> list[str]:
    """The end of an emulator case: every output saved."""
    lines = [f'    vx_save(dir + "/out{i}.bin", out{i});' for i in range(len(k.dnames))]
    return [*lines, "    return 0;\n  }"]


def scoped_source(k) -> str:
    """A registered kernel's source (``k.source``) for the emulator's one translation unit:
    its spec's header macros (``k.spec.defines``) undefined after it, so they do not reach the
    kernels that follow (MLX compiles every kernel on its own)."""
    ends = "".join(f"\n#undef {d.split()[0]}" for d in k.spec.defines)
    return k.source + ends
