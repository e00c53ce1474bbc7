"""The CUDA kernels' disk cache: MLX's module naming, its file layout, and the fallback.

Also the kernels' texts handed to MLX as ``#include`` lines (``KernelConfig.cuda_include``).
The compile itself runs on an NVIDIA GPU only (``tests/test_gpu_caches.py`` runs every kernel
through it there; ``benchmarks/first_use.py`` times a second process's first use).
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import mlx.core as mx
import numpy as np
import pytest

from velox_core.kernels import build, disk_cache
from velox_core.kernels.config import configured


# libstdc++'s std::hash<std::string> of each input, printed by a g++ 12 program
# (`std::cout << std::hex << std::hash<std::string>{}(s)`).
@pytest.mark.parametrize(
    "data, expected",
    [
        (b"", 0x553E93901E462A6E),
        (b"abc", 0x32D82BF8ED3DBA39),
        (b"abcdefgh", 0x783DB3E38DB898BB),
        (b"hello world, a longer string!", 0x201F5E90B0A5F2D6),
    ],
)
def test_std_hash_matches_libstdcxx(data, expected):
    assert disk_cache.std_hash(data) == expected


def test_module_name_is_kernel_name_and_source_hash():
    assert (
        disk_cache.module_name("custom_kernel_k_4", "abc") == "custom_kernel_k_4_32d82bf8ed3dba39"
    )


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("MLX_PTX_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    disk_cache.ptx_cache_dir.cache_clear()
    yield tmp_path
    disk_cache.ptx_cache_dir.cache_clear()


def test_ptx_path_splits_long_names_into_folders(cache_dir):
    assert disk_cache.ptx_path("m") == cache_dir / "m.ptx"
    long = "a" * 245 + "b" * 245 + "c" * 10
    assert disk_cache.ptx_path(long) == cache_dir / ("a" * 245) / ("b" * 245) / ("c" * 10 + ".ptx")


SPEC = build.KernelSpec(
    name="velox_test_copy", source="decode_merge.metal", inputs=("x",), outputs=("y",)
)


def test_ensure_compiled_writes_binary_and_names_once(cache_dir, monkeypatch):
    calls = []

    def fake_compile(source, kernel, file_name):
        calls.append((source, kernel, file_name))
        return b"\x7fELF-binary", "_Z4mangled"

    monkeypatch.setattr(disk_cache, "compile_cuda", fake_compile)
    x = mx.zeros((4, 8), dtype=mx.float16)
    tmpl = [("N", 8), ("T", mx.float16), ("B", True)]
    source, kname = SPEC.mlx_source([x], [mx.float32], tmpl)
    texts = SPEC.mlx_texts("cuda")
    assert (source, kname) == build.cuda_source(
        SPEC, [build.ArgInfo.of(x)], [mx.float32], tmpl, texts
    )
    path = disk_cache.ensure_compiled(source, kname)
    assert kname == "custom_kernel_velox_test_copy_8_float16_t_t"
    assert path == cache_dir / (disk_cache.module_name(kname, source) + ".ptx")
    assert path.read_bytes() == b"\x7fELF-binary"
    names = path.with_suffix(".txt").read_text()
    assert names == f"mlx::core::cu::{kname}\t_Z4mangled\n"
    assert calls == [(source, "mlx::core::cu::" + kname, path.stem + ".cu")]
    disk_cache.ensure_compiled(source, kname)  # present: not compiled again
    assert len(calls) == 1
    assert not list(cache_dir.glob(".velox-*"))


class _Kernel:
    def __init__(self):
        self.calls = []

    def __call__(self, **kwargs):
        self.calls.append(kwargs)
        return ["out"]


def test_cached_kernel_compiles_each_variant_once_and_passes_calls_on(monkeypatch):
    seen = []
    monkeypatch.setattr(disk_cache, "ensure_compiled", lambda *a: seen.append(a))
    inner = _Kernel()
    k = disk_cache.CachedKernel(inner, lambda i, o, t: (f"src{t}", "name"))
    for n in (8, 8, 16):
        out = k(inputs=["x"], output_dtypes=[mx.float16], template=[("N", n)], grid=(1, 1, 1))
        assert out == ["out"]
    assert seen == [("src[('N', 8)]", "name"), ("src[('N', 16)]", "name")]
    assert len(inner.calls) == 3
    assert inner.calls[0] == {
        "inputs": ["x"],
        "output_dtypes": [mx.float16],
        "template": [("N", 8)],
        "grid": (1, 1, 1),
    }


def test_cached_kernel_failure_reports_once_and_leaves_mlx_to_compile(monkeypatch, capsys):
    def fail(*a):
        raise OSError("no NVRTC library found")

    monkeypatch.setattr(disk_cache, "ensure_compiled", fail)
    monkeypatch.setattr(disk_cache.CachedKernel, "failed", False)
    inner = _Kernel()
    k = disk_cache.CachedKernel(inner, lambda i, o, t: ("src", "name"))
    k(inputs=[], output_dtypes=[mx.float16], template=[("N", 1)])
    k(inputs=[], output_dtypes=[mx.float16], template=[("N", 2)])
    assert len(inner.calls) == 2
    err = capsys.readouterr().err
    assert err.count("velox: kernels are not kept on disk (no NVRTC library found)") == 1
    assert disk_cache.CachedKernel.failed


def test_disk_cache_switch(monkeypatch):
    inner = _Kernel()
    with configured(disk_cache=False):
        assert disk_cache.wrap(inner, SPEC.mlx_source) is inner
    with configured(disk_cache=True):
        assert isinstance(disk_cache.wrap(inner, SPEC.mlx_source), disk_cache.CachedKernel)
    with configured(disk_cache=True):
        monkeypatch.setattr(disk_cache.mx, "__version__", "0.99.0")  # a release not followed
        assert disk_cache.wrap(inner, SPEC.mlx_source) is inner
    from velox_core.kernels.config import KernelConfig

    assert KernelConfig.from_environ({"VELOX_KERNEL_CACHE": "0"}).disk_cache is False
    assert KernelConfig.from_environ({}).disk_cache is True


# -- the kernels' texts handed to MLX as #include lines ------------------------------------------


def test_included_texts_hold_the_full_texts(tmp_path, monkeypatch):
    """With ``cuda_include`` the header and body MLX sees are short ``#include`` lines of files
    holding the full texts (named by digest); the body keeps the launch prologue inline and
    names the shape arguments it uses, so MLX declares the same arguments."""
    from velox_core.kernels import portable as kport

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    spec = kport.DECODE
    with configured(cuda_include=True):
        header, body = spec.mlx_texts("cuda")
        assert spec.mlx_texts("metal") == (spec.header("metal"), spec.body("metal"))
    assert header.startswith('#include "') and header.count("\n") == 1
    included = header.split('"')[1]
    assert included.startswith(str(tmp_path)) and Path(included).read_text() == spec.header("cuda")
    assert body.startswith(build.PROLOGUE["cuda"])
    inner = body.rsplit('#include "', 1)[1].split('"')[0]
    full = spec.body("cuda")
    assert full == build.PROLOGUE["cuda"] + build._SILENCE + Path(inner).read_text()
    assert len(header) + len(body) < 1000 < len(spec.header("cuda")) + len(full)
    assert build._shape_infos(body, spec.inputs) == build._shape_infos(full, spec.inputs)
    with configured(cuda_include=False):
        assert spec.mlx_texts("cuda") == (spec.header("cuda"), full)


needs_gxx = pytest.mark.skipif(
    __import__("shutil").which("g++") is None, reason="g++ compiles the CUDA emulation"
)


@needs_gxx
def test_included_texts_compile_and_run_in_the_cuda_emulation(tmp_path, monkeypatch):
    """The included form compiles as the full one does (g++ through the CUDA emulation): the
    subnormal probe, which takes the tensor-core header, gives exact sums."""
    from velox_core.kernels import mma_support as kmsup
    from velox_testing.emulate import CudaEmulator

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "texts"))
    with configured(cuda_include=True):
        emu = CudaEmulator(tmp_path / "emu")
        salt = np.array([kmsup.SUBNORMAL_SALT], np.uint32)
        handle = emu.kernel(kmsup.PROBE_SUBNORMAL, [salt], ["float32"], [])
        assert '#include "' + str(tmp_path / "texts") in emu.source()
        (out,) = emu.run(handle, [salt], [(128,)], (32, 1, 1), (32, 1, 1))
    assert kmsup.subnormal_probe_error(out, kmsup.SUBNORMAL_SALT) == 0.0


def test_included_texts_fall_back_to_the_texts_without_a_writable_folder(tmp_path, monkeypatch):
    from velox_core.kernels import merge as kmerge

    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv("XDG_CACHE_HOME", str(blocker))  # <file>/velox/cuda-src: not creatable
    with configured(cuda_include=True):
        assert kmerge.MERGE.mlx_texts("cuda") == (
            kmerge.MERGE.header("cuda"),
            kmerge.MERGE.body("cuda"),
        )


def test_a_changed_text_file_is_rewritten(tmp_path, monkeypatch):
    from velox_core.kernels import merge as kmerge

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    with configured(cuda_include=True):
        header, _ = kmerge.MERGE.mlx_texts("cuda")
        path = Path(header.split('"')[1])
        path.write_text("garbage")
        assert kmerge.MERGE.mlx_texts("cuda")[0] == header
    assert path.read_text() == kmerge.MERGE.header("cuda")


def test_cached_kernel_skips_the_key_for_the_same_template_object(monkeypatch):
    renders = []
    monkeypatch.setattr(disk_cache, "ensure_compiled", lambda *a: None)
    k = disk_cache.CachedKernel(_Kernel(), lambda i, o, t: renders.append(t) or ("s", "n"))
    tmpl = [("N", 8)]
    for _ in range(3):
        k(inputs=[], output_dtypes=[mx.float16], template=tmpl)
    k(inputs=[], output_dtypes=[mx.float16], template=[("N", 9)])
    assert renders == [[("N", 8)], [("N", 9)]]


def test_a_planned_merge_calls_the_wrapper_once_per_variant_then_mlx_kernel(monkeypatch):
    """plan_merge_fp16's run launches through the CachedKernel the first time a template is
    used (compiling it into the disk cache) and straight through MLX's kernel after that."""
    from velox_core.kernels import merge

    monkeypatch.setattr(disk_cache, "ensure_compiled", lambda *a: None)
    inner, wrapped = _Kernel(), []
    cached = disk_cache.CachedKernel(inner, lambda i, o, t: ("s", "n"))
    real_call = disk_cache.CachedKernel.__call__

    def counting(self, **kw):
        wrapped.append(kw["template"])
        return real_call(self, **kw)

    monkeypatch.setattr(disk_cache.CachedKernel, "__call__", counting)
    monkeypatch.setattr(merge, "MERGE_FP16", SimpleNamespace(kernel=lambda: cached))
    run = merge.plan_merge_fp16(1, 2, 4, 8, mx.float16, None, None)
    seg = (mx.zeros((1, 2, 3, 8), mx.float16),) * 2
    for fp16 in ([seg], [seg], [seg, seg], [seg]):
        run(mx.zeros((1, 2, 1, 4, 8)), mx.zeros((1, 2, 1, 4, 2)), mx.zeros((1, 2, 4, 8)), fp16)
    assert len(inner.calls) == 4
    assert [dict(t)["HAS_B"] for t in wrapped] == [0, 1]  # each template's first launch only
