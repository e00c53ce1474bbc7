"""Run a kernel's Metal instantiation (or, for the CUDA-only kernels, its CUDA instantiation:
:class:`CudaEmulator`) on the CPU, through C++ shims (a test aid).

The full function MLX would compile for Metal (:func:`velox_testing.metal_source.metal_source`)
is compiled with ``g++`` against ``metal/shim/metal_shim.h``, which runs every threadgroup as
real threads with real barriers and SIMD-group shuffles. The body therefore executes exactly
as written — index arithmetic, bit extraction, cross-lane reductions, the online softmax,
threadgroup memory — and its outputs can be compared with the MLX reference on any machine.
What it cannot show is GPU-specific behaviour (memory ordering without barriers, performance).

Needs a C++17 compiler (``g++``, or ``$CXX``) and a repository checkout (the shim is not
shipped in wheels). Inputs are numpy arrays, possibly strided views (their strides are passed
to the kernel like MLX passes ``name_strides``); bfloat16 inputs are given as ``(uint16 array,
"bfloat16")``. The C++ around the kernels (types, file I/O, each case's loads and saves) is in
:mod:`velox_testing.emulate_io`.
"""

from __future__ import annotations

import os
import subprocess
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from velox_core.kernels import _source_dirs
from velox_core.kernels.build import ArgInfo, KernelSpec, _shape_infos, cuda_source

from .emulate_build import build_program, compiler
from .emulate_io import (
    CUDA_TYPES,
    CXX_TYPES,
    IO_HELPERS,
    METAL_IDS,
    NP_TYPES,
    case_arguments,
    case_saves,
    scoped_source,
    write_input,
)
from .metal_source import metal_attributes, metal_source, source_digest

__all__ = [
    "CudaEmulator",
    "EmulatedKernels",
    "Emulator",
    "compiler",
    "emulated_or_skip",
    "shim_dir",
]


def emulated_or_skip(monkeypatch, tmp_path: Path, backend: str = "metal") -> EmulatedKernels:
    """One test's kernel launches sent to the emulator (:meth:`EmulatedKernels.install`,
    working in ``tmp_path``), or the test skipped (``pytest.skip``) where no C++ compiler is
    installed: the fixture the method packages' kernel tests share."""
    import pytest

    if compiler() is None:
        pytest.skip("no C++ compiler (g++ or $CXX): the kernels cannot be emulated")
    return EmulatedKernels(tmp_path, backend=backend).install(monkeypatch)


def shim_dir() -> Path:
    """``metal/shim`` of the repository checkout."""
    for d in _source_dirs("velox_core"):
        if (d / "shim" / "metal_shim.h").is_file():
            return d / "shim"
    raise FileNotFoundError("metal/shim not found: the emulator needs a repository checkout")


def _name_of(a: Any) -> tuple[np.ndarray, str]:
    if isinstance(a, tuple):
        arr, name = a
        return np.asarray(arr), name
    arr = np.asarray(a)
    return arr, str(arr.dtype)


@dataclass
class _Kernel:
    spec: KernelSpec
    infos: tuple[ArgInfo, ...]
    dnames: tuple[str, ...]
    template: tuple[tuple[str, Any], ...]
    sequential: bool
    source: str
    name: str


class Emulator:
    """Compiles kernels' Metal instantiations into one CPU program and runs them.

    Register every kernel first (:meth:`kernel`), then :meth:`run` them: the first run
    compiles all registered kernels at once (one ``g++`` call; binaries are cached in
    ``workdir`` by source digest).
    """

    def __init__(self, workdir: str | os.PathLike | None = None, opt: str = "-O1"):
        self.workdir = Path(workdir or tempfile.mkdtemp(prefix="velox-emu-"))
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.opt = opt
        self._kernels: list[_Kernel] = []
        self._exe: Path | None = None

    def kernel(
        self,
        spec: KernelSpec,
        inputs: Sequence[Any],
        output_dtypes: Sequence[Any],
        template: Sequence[tuple[str, Any]] = (),
        sequential: bool = False,
    ) -> int:
        """Register a kernel instantiation (inputs only set its dtypes, ranks and sizes, as in
        MLX's generated signature); returns the handle for :meth:`run`."""
        infos = tuple(ArgInfo(name, arr.ndim, int(arr.size)) for arr, name in map(_name_of, inputs))
        dnames = tuple(str(d).replace("mlx.core.", "") for d in output_dtypes)
        src, kname = self._generate(spec, infos, dnames, template)
        for i, k in enumerate(self._kernels):
            if k.source == src and k.sequential == sequential:
                return i
        self._kernels.append(_Kernel(spec, infos, dnames, tuple(template), sequential, src, kname))
        self._exe = None
        return len(self._kernels) - 1

    # Metal passes inputs of fewer than 8 elements in the constant address space (another
    # signature); CUDA does not
    _small_inputs_differ = True

    def _generate(self, spec, infos, dnames, template) -> tuple[str, str]:
        return metal_source(spec, infos, dnames, template)

    def _include_dirs(self) -> list[Path]:
        return [shim_dir()]

    def _case(self, idx: int, k: _Kernel) -> list[str]:
        body = k.spec.body("metal")
        used = _shape_infos(body, k.spec.inputs)
        targs = ""
        if k.template:
            vals = []
            for _, v in k.template:
                if isinstance(v, bool):
                    vals.append(str(int(v)))
                elif isinstance(v, int):
                    vals.append(str(v))
                else:
                    vals.append(CXX_TYPES[str(v).replace("mlx.core.", "")])
            targs = "<" + ", ".join(vals) + ">"
        lines, call = case_arguments(k, used, CXX_TYPES, cuda=False)
        lines.insert(0, f"  if (which == {idx}) {{")
        for attr, _ in metal_attributes(body):
            if attr not in METAL_IDS:
                raise ValueError(f"emulator: Metal attribute {attr!r} is not emulated")
            call.append(METAL_IDS[attr])
        seq = "true" if k.sequential else "false"
        lines.append(
            f"    vx_emu::run_grid(grid, tg, {seq}, [&](const vx_emu::Ids& id) {{ "
            f"{k.name}{targs}({', '.join(call)}); }});"
        )
        return lines + case_saves(k)

    def source(self) -> str:
        """The program: every registered Metal instantiation plus a ``main`` that loads the
        inputs, runs the kernel named on the command line over its grid, saves the outputs."""
        lines = ["#define VX_SHIM_EMULATE 1", '#include "metal_shim.h"']
        lines += [scoped_source(k) for k in self._kernels]
        lines += [
            *IO_HELPERS,
            "  uint3 grid, tg; lf >> grid.x >> grid.y >> grid.z >> tg.x >> tg.y >> tg.z;",
        ]
        for idx, k in enumerate(self._kernels):
            lines += self._case(idx, k)
        lines.append("  return 3;\n}")
        return "\n".join(lines) + "\n"

    def build(self) -> Path:
        """Compile every registered kernel (cached by source digest:
        :func:`~velox_testing.emulate_build.build_program`); raises with the compiler's
        output on failure."""
        if self._exe is None:
            self._exe = build_program(self.source(), self.opt, self._include_dirs(), self.workdir)
        return self._exe

    def run(
        self,
        handle: int,
        inputs: Sequence[Any],
        output_shapes: Sequence[Sequence[int]],
        grid: tuple[int, int, int],
        threadgroup: tuple[int, int, int],
        init: float | None = None,
    ) -> list[np.ndarray]:
        """Run a registered kernel like ``kernel(inputs=..., grid=..., threadgroup=...)``.

        ``init``: MLX's ``init_value``; only 0 (outputs zeroed) or None (outputs start as
        garbage, all bytes 255, as uninitialized memory may). Returns numpy outputs
        (bfloat16 outputs as uint16 bit patterns).
        """
        if init not in (None, 0):
            raise ValueError(f"emulator: init_value must be None or 0, got {init!r}")
        k = self._kernels[handle]
        arrs = [_name_of(a) for a in inputs]
        got = tuple(ArgInfo(name, arr.ndim, int(arr.size)) for arr, name in arrs)
        small = self._small_inputs_differ
        if [(i.dtype, i.ndim, small and i.size < 8) for i in got] != [
            (i.dtype, i.ndim, small and i.size < 8) for i in k.infos
        ]:
            raise ValueError("emulator: inputs do not match the registered kernel's signature")
        exe = self.build()
        with tempfile.TemporaryDirectory(dir=self.workdir) as tmp:
            d = Path(tmp)
            for i, (arr, _) in enumerate(arrs):
                write_input(d / f"in{i}", arr)
            sizes = [int(np.prod(s)) for s in output_shapes]
            launch = [*grid, *threadgroup, *sizes, 255 if init is None else 0]
            (d / "launch.meta").write_text(" ".join(str(v) for v in launch))
            res = subprocess.run(
                [str(exe), str(d), str(handle)], capture_output=True, text=True, check=False
            )
            if res.returncode != 0:
                raise RuntimeError(
                    f"emulated kernel failed ({res.returncode}): {res.stderr[-4000:]}"
                )
            outs = []
            for i, (shape, name) in enumerate(zip(output_shapes, k.dnames)):
                raw = np.fromfile(d / f"out{i}.bin", dtype=NP_TYPES[name])
                outs.append(raw.reshape(tuple(shape)))
            return outs


class CudaEmulator(Emulator):
    """Compiles kernels' CUDA instantiations (:func:`velox_core.kernels.build.cuda_source`)
    with ``g++`` against ``metal/shim/cuda_emu`` and runs them on the CPU: every block as real
    threads, warp shuffles, votes, ``__syncwarp`` / ``__syncthreads`` barriers, and the
    tensor-core and ``cp.async`` helpers of ``velox_mma.cuh`` emulated lane by lane. For the
    CUDA-only kernels (``decode_attention_mma.cu``), which no Metal instantiation covers.
    Same interface as :class:`Emulator`; ``grid`` is in threads, as MLX's ``cuda_kernel``
    takes it."""

    _small_inputs_differ = False

    def _generate(self, spec, infos, dnames, template) -> tuple[str, str]:
        return cuda_source(spec, infos, dnames, template, spec.mlx_texts("cuda"))

    def _include_dirs(self) -> list[Path]:
        return [shim_dir() / "cuda_emu", shim_dir()]

    def _case(self, idx: int, k: _Kernel) -> list[str]:
        body = k.spec.body("cuda")
        used = _shape_infos(body, k.spec.inputs)
        lines, call = case_arguments(k, used, CUDA_TYPES, cuda=True)
        lines.insert(0, f"  if (which == {idx}) {{")
        lines.append(
            "    vx_cuemu::launch(blocks, block, [&] { "
            f"mlx::core::cu::{k.name}({', '.join(call)}); }});"
        )
        return lines + case_saves(k)

    def source(self) -> str:
        lines = [scoped_source(k) for k in self._kernels]
        lines += [
            *IO_HELPERS,
            "  dim3 grid, block;",
            "  lf >> grid.x >> grid.y >> grid.z >> block.x >> block.y >> block.z;",
            "  dim3 blocks{(grid.x + block.x - 1) / block.x, (grid.y + block.y - 1) / block.y,",
            "              (grid.z + block.z - 1) / block.z};",
        ]
        for idx, k in enumerate(self._kernels):
            lines += self._case(idx, k)
        lines.append("  return 3;\n}")
        return "\n".join(lines) + "\n"


def np_input(a: Any) -> Any:
    """An MLX array as an emulator input (bfloat16 as its uint16 bit pattern)."""
    import mlx.core as mx

    if isinstance(a, mx.array) and a.dtype == mx.bfloat16:
        return np.array(a.view(mx.uint16)), "bfloat16"
    return np.array(a)


def mma_fused_parts(lay: Any, ws: np.ndarray) -> tuple[np.ndarray, ...]:
    """``(o_part, ml_part, out, mlo, count)``: views of the emulated tensor-core kernel's one
    output ``ws`` when it merges its own splits (``FUSE`` 1), at the offsets of ``lay``
    (:func:`velox_core.kernels.mma.mma_layout`); a bfloat16 ``out`` comes widened to float32."""
    b, h, s, m, d = lay.b, lay.h, lay.splits, lay.rows, lay.dim
    o_part = ws[lay.o_off : lay.o_off + b * h * s * m * d].reshape(b, h, s, m, d)
    ml_part = ws[lay.ml_off : lay.ml_off + b * h * s * m * 2].reshape(b, h, s, m, 2)
    name = str(lay.out_dtype).replace("mlx.core.", "")
    bf16 = name == "bfloat16"
    out = ws[: lay.mlo_off].view(np.uint16 if bf16 else name)[: b * h * m * d].reshape(b, h, m, d)
    if bf16:
        out = (out.astype(np.uint32) << 16).view(np.float32)
    mlo = ws[lay.mlo_off : lay.mlo_off + b * h * m * 2].reshape(b, h, m, 2)
    count = ws[lay.count_off : lay.count_off + b * h].view(np.uint32)
    return o_part, ml_part, out, mlo, count


def _padded_view(x: Any, pad: int, rng: np.random.Generator) -> Any:
    """The same values as a token-axis slice of a larger buffer filled with garbage."""
    arr, name = _name_of(x)
    shape = list(arr.shape)
    shape[2] += pad
    if np.issubdtype(arr.dtype, np.integer):
        big = rng.integers(0, np.iinfo(arr.dtype).max, size=shape, dtype=arr.dtype)
    else:
        big = rng.standard_normal(shape).astype(arr.dtype) * 1e4
    big[:, :, : arr.shape[2]] = arr
    view = big[:, :, : arr.shape[2]]
    return (view, name) if isinstance(x, tuple) else view


class DecodeRun:
    """The decode kernel and its merge for one case, run on the CPU through the emulator.

    Args:
        emu: the emulator (register every case before the first run: one compile).
        q, keys, values: as for :func:`velox_core.kernels.decode.decode_attention`
            (``q_sketch`` too, with keys that carry a residual sketch).
        splits: context chunks (default: the library's choice).
        pad: read every token-axis input as a slice of a ``T + pad`` token buffer whose
            extra rows hold garbage (tests the strided reads and the split bounds).

    Calling it returns ``(o, m, l)`` as numpy float32, shaped like the library's result.
    """

    def __init__(
        self,
        emu: Emulator,
        q,
        keys,
        values,
        splits: int | None = None,
        pad: int = 0,
        q_sketch=None,
    ):
        import mlx.core as mx

        from velox_core.kernels import layout as klayout
        from velox_core.kernels import merge as kmerge
        from velox_core.kernels import portable as kport

        b, h, m, dim = q.shape
        t = keys.codes.shape[2]
        p = kport.plan_for(m, dim, keys, values)
        if p is None:
            raise ValueError("DecodeRun: the kernel does not support this case")
        self.plan, self.m = p, m
        mp = p.nmb * p.mb
        qf = q.astype(mx.float32)
        if mp > m:
            qf = mx.concatenate([qf, mx.zeros((b, h, mp - m, dim), mx.float32)], axis=2)
        self.s = (
            kport.choose_splits(t, b * h, p) if splits is None else kport.fit_splits(t, splits, p)
        )
        self.s = kport.block_splits(t, self.s, p, keys)
        rng = np.random.default_rng(0)
        ins = [np_input(qf)]
        for side in (keys, values):
            arrays = klayout.code_inputs(side)
            for i, a in enumerate(arrays):
                x = np_input(a)
                unused = (i == 1 and side.a is None) or (i == 2 and side.b is None)
                if pad and i < 3 and not unused:
                    x = _padded_view(x, pad, rng)
                ins.append(x)
        along = klayout.layout_of(keys).query_token_inputs(keys)  # query-side inputs per token
        for i, a in enumerate(klayout.sketch_inputs(keys, q_sketch, mp)):
            x = np_input(a)
            if pad and i in along:
                x = _padded_view(x, pad, rng)
            ins.append(x)
        self.inputs = ins
        self.shapes = [(b, h, self.s, mp, dim), (b, h, self.s, mp, 2)]
        self.merge_shapes = [(b, h, mp, dim), (b, h, mp, 1), (b, h, mp, 1)]
        self.grid = (self.s * p.nwarps * 32, b * h, p.nmb)
        self.tg = (p.nwarps * 32, 1, 1)
        self.rows = b * h * mp
        self.emu = emu
        self.k_decode = emu.kernel(
            kport.decode_spec(keys), ins, ["float32"] * 2, kport.template(p, dim, keys, values)
        )
        parts = [np.zeros(s, np.float32) for s in self.shapes]
        self.k_merge = emu.kernel(kmerge.MERGE, parts, ["float32"] * 3)

    def partials(self) -> list[np.ndarray]:
        """The decode kernel's per-split outputs ``(o_part, ml_part)``."""
        return self.emu.run(self.k_decode, self.inputs, self.shapes, self.grid, self.tg)

    def __call__(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        o_part, ml = self.partials()
        from velox_core.kernels.merge import merge_launch

        grid, tg = merge_launch(self.rows, self.shapes[0][-1])
        o, mm, ll = self.emu.run(self.k_merge, [o_part, ml], self.merge_shapes, grid, tg)
        k = self.m
        return o[:, :, :k], mm[:, :, :k], ll[:, :, :k]


class EmulatedKernels:
    """Stand-ins for MLX's kernel objects that run the Metal (or, with ``backend="cuda"``, the
    CUDA) instantiation on the CPU.

    ``KernelSpec.kernel`` patched to :meth:`kernel_for` (and the backend reported as
    ``"metal"`` or ``"cuda"``) sends the library's own calls (``decode_attention``,
    ``affine_encode``...) with their own inputs, templates, grids and output shapes to the
    emulator, so the whole host-side path is exercised as it runs on a GPU. Inputs are copied
    to contiguous arrays
    (strided reads are covered by :class:`DecodeRun`); one program is compiled per distinct
    instantiation.
    """

    def __init__(self, workdir: str | os.PathLike | None = None, backend: str = "metal"):
        if backend not in ("metal", "cuda"):
            raise ValueError(f"backend must be 'metal' or 'cuda', got {backend!r}")
        self.workdir = Path(workdir or tempfile.mkdtemp(prefix="velox-emu-"))
        self.backend = backend
        self.calls: list[tuple[str, tuple[tuple[str, Any], ...]]] = []
        self._emus: dict[str, tuple[Emulator, int]] = {}

    def install(self, monkeypatch) -> EmulatedKernels:
        """Send the library's kernel launches here for one test: the backend reported as this
        emulator's and ``KernelSpec.kernel`` patched, through ``monkeypatch`` (pytest's
        fixture, which undoes both after the test)."""
        from velox_core import kernels as vk

        monkeypatch.setattr(vk, "backend", lambda: self.backend)
        monkeypatch.setattr(KernelSpec, "kernel", lambda spec: self.kernel_for(spec))
        return self

    @property
    def names(self) -> list[str]:
        """The kernels called so far, in order."""
        return [name for name, _ in self.calls]

    def kernel_for(self, spec: KernelSpec):
        def call(
            *,
            inputs,
            output_shapes,
            output_dtypes,
            grid,
            threadgroup,
            template=None,
            init_value=None,
            verbose=False,
            stream=None,
        ):
            return self._call(
                spec, inputs, output_shapes, output_dtypes, grid, threadgroup, template, init_value
            )

        return call

    def _call(
        self, spec, inputs, output_shapes, output_dtypes, grid, threadgroup, template, init=None
    ):
        import mlx.core as mx

        if len(output_shapes) != len(spec.outputs):
            raise ValueError(
                f"{spec.name}: {len(output_shapes)} output shapes for the outputs {spec.outputs}"
            )
        ins = [np_input(a) for a in inputs]
        tmpl = tuple(template or ())
        dnames = [str(d).replace("mlx.core.", "") for d in output_dtypes]
        infos = [ArgInfo(name, arr.ndim, int(arr.size)) for arr, name in map(_name_of, ins)]
        generate = cuda_source if self.backend == "cuda" else metal_source
        key = source_digest(generate(spec, infos, dnames, tmpl)[0])
        if key not in self._emus:
            emu = (CudaEmulator if self.backend == "cuda" else Emulator)(self.workdir / key)
            self._emus[key] = (emu, emu.kernel(spec, ins, dnames, tmpl))
        emu, handle = self._emus[key]
        self.calls.append((spec.name, tmpl))
        outs = emu.run(
            handle, ins, [tuple(s) for s in output_shapes], tuple(grid), tuple(threadgroup), init
        )
        res = []
        for o, name in zip(outs, dnames):
            a = mx.array(o)
            res.append(a.view(mx.bfloat16) if name == "bfloat16" else a)
        return res
