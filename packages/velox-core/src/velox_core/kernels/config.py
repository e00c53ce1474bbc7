"""The kernels' configuration: one typed, frozen record, read once.

Every kernel variant and tuning knob is a field of :class:`KernelConfig`, with its default.
The configuration in force is :func:`kernel_config` (built from the environment on first
use, then kept); :func:`configure` replaces it for the process and :func:`configured` for a
``with`` block (tests, benchmarks comparing variants). Nothing on the hot path reads the
environment: plans are keyed on the configuration record itself.

The environment is read once, at first use, for these names (each a field below):
``VELOX_KERNELS=0`` turns every kernel off (reference MLX everywhere; the one switch meant
for users); the ``VELOX_DECODE_*`` settings tune the kernels on a new GPU
(docs/architecture.md lists them). A method package's own kernel settings live in that
package (a :class:`PackageSettings`), read the same way; it names them with
:func:`register_settings`. A field left at ``None`` takes the rule its accessor documents
(e.g. the tensor-core kernel's split count from the device's SM count).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, ClassVar

__all__ = [
    "ENVIRONMENT",
    "KernelConfig",
    "PackageSettings",
    "configure",
    "configured",
    "kernel_config",
    "register_settings",
    "settings_of",
]

_OFF = ("0", "false", "no", "off")


def _choice(name: str, value: object, allowed: tuple) -> None:
    if value not in allowed:
        alts = ", ".join(str(a) for a in allowed)
        raise ValueError(f"{name} must be one of {alts}, got {value!r}")


def _range(name: str, value: object, lo: int, hi: int | None) -> None:
    ok = isinstance(value, int) and not isinstance(value, bool) and value >= lo
    if not ok or (hi is not None and value > hi):
        to = f" to {hi}" if hi is not None else " or more"
        raise ValueError(f"{name} must be an integer {lo}{to}, got {value!r}")


@dataclass(frozen=True)
class KernelConfig:
    """Kernel variants and tuning (defaults: what the benchmarks chose on an H200).

    Attributes:
        enabled: use the kernels at all (``VELOX_KERNELS``).
        decode_warps: warps per threadgroup of the portable decode kernel (1, 2, 4, 8).
        decode_unroll: tokens per lane per loop iteration of the portable kernel (1 to 16).
        blocks: threadgroups a split decode aims for (None: 1,024 for the portable kernel;
            the tensor-core kernel sizes whole waves from the SM count).
        sms: the device's SM count (None: asked of the CUDA driver).
        mma: use the tensor-core decode kernel on CUDA where it takes the layout.
        symmetric: the tensor-core kernel uses the symmetry of levels a caller vouches for.
        mma_warps: warps per threadgroup of the tensor-core kernel (1, 2, 4, 8).
        mma_sm_blocks: threadgroups per SM its register cap aims for (0: no cap; None: 12
            warps' worth).
        subtiles: 16-token tiles per loop step, at most (1, 2, 4).
        stages: ring stages (2 to 8; None: the most of 4, 3, 2 that fit).
        p_residual: carry the softmax weights' fp16 rounding residual (a second value MMA;
            off: the weights rounded to fp16, as flash attention does, about 2^-11 relative).
        pipeline: score the next step before consuming the current one (a software
            pipeline: at least 3 ring stages, without the residual; on and off measured
            within the run-to-run spread on an H200 at two tiles a step).
        value_fold / key_fold: fold the value / key scales out of the MMAs where they can.
        ldsm: read code words out of the ring with ldmatrix (the keys with ``KFOLD``, the
            values with ``VFOLD`` in 16-bit units).
        fuse: the tensor-core kernel merges its own splits (None: up to 16,384 tokens).
        layouts_off: names of code layouts the kernels decline
            (:mod:`velox_core.kernels.layout`; e.g. ``{"vq"}``): their segments take the
            reference path.
        disk_cache: on CUDA, compile each kernel into MLX's PTX disk cache, so that later
            processes load it instead of compiling it (:mod:`velox_core.kernels.disk_cache`).
        compile_ahead: with the disk cache on CUDA, compile a block's new kernel variants
            together in a pool and the first decode step's during the prefill; off, each
            call compiles its own variant when it is made, one after another.
        compile_processes: with the disk cache on CUDA, each compile runs NVRTC in a worker
            process of its own (:mod:`velox_core.kernels.nvrtc`: one process compiles one
            program at a time), beside the others and beside MLX's own compiles; off (the
            default until a GPU measures the workers), in this process's threads.
        cuda_include: on CUDA, hand MLX each kernel's texts as ``#include`` lines of files
            holding them, which shortens MLX's work per call
            (:meth:`velox_core.kernels.build.KernelSpec.mlx_texts`).
        latent_codes: a multi-head latent attention layer's decode step attends from the
            latent's codes with MLX's ``quantized_matmul`` (:mod:`velox_core.cache.absorbed`);
            None: on the CPU and Metal, not on CUDA, where it measures no faster.
    """

    enabled: bool = True
    decode_warps: int = 4
    decode_unroll: int = 4
    blocks: int | None = None
    sms: int | None = None
    mma: bool = True
    symmetric: bool = True
    mma_warps: int = 4
    mma_sm_blocks: int | None = None
    subtiles: int = 4
    stages: int | None = None
    p_residual: bool = False
    pipeline: bool = True
    value_fold: bool = True
    key_fold: bool = True
    ldsm: bool = True
    fuse: bool | None = None
    layouts_off: frozenset[str] = frozenset()
    disk_cache: bool = True
    compile_ahead: bool = True
    compile_processes: bool = False
    cuda_include: bool = True
    latent_codes: bool | None = None

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if f.type in ("bool", "bool | None") and not (
                isinstance(v, bool) or (v is None and "None" in f.type)
            ):
                raise TypeError(f"KernelConfig.{f.name} must be True or False, got {v!r}")
        _choice("KernelConfig.decode_warps", self.decode_warps, (1, 2, 4, 8))
        _range("KernelConfig.decode_unroll", self.decode_unroll, 1, 16)
        if self.blocks is not None:
            _range("KernelConfig.blocks", self.blocks, 1, None)
        if self.sms is not None:
            _range("KernelConfig.sms", self.sms, 1, None)
        _choice("KernelConfig.mma_warps", self.mma_warps, (1, 2, 4, 8))
        if self.mma_sm_blocks is not None:
            _range("KernelConfig.mma_sm_blocks", self.mma_sm_blocks, 0, 32)
        _choice("KernelConfig.subtiles", self.subtiles, (1, 2, 4))
        if self.stages is not None:
            _range("KernelConfig.stages", self.stages, 2, 8)
        if not isinstance(self.layouts_off, frozenset) or not all(
            isinstance(n, str) and n.isidentifier() for n in self.layouts_off
        ):
            raise TypeError(
                "KernelConfig.layouts_off must be a frozenset of layout names (identifiers "
                f"such as 'vq'), got {self.layouts_off!r}"
            )

    def replace(self, **changes: object) -> KernelConfig:
        """A copy with ``changes`` (field names; unknown ones are a TypeError)."""
        return dataclasses.replace(self, **changes)

    @staticmethod
    def from_environ(environ: Mapping[str, str] | None = None) -> KernelConfig:
        """The defaults, overridden by the ``VELOX_*`` settings of ``environ`` (default
        ``os.environ``) named in :data:`ENVIRONMENT`.

        Raises:
            ValueError: a setting's value is not one it takes (the message names it).
        """
        return _from_environ(KernelConfig, ENVIRONMENT, environ)


def _from_environ(cls: type, table: Mapping[str, tuple[str, str]], environ) -> Any:
    """``cls`` (a frozen dataclass) from the settings of ``environ`` named in ``table``
    (field -> (environment name, kind)); a bad value is a ValueError naming the setting."""
    env = os.environ if environ is None else environ
    changes: dict[str, object] = {}
    for field, (name, kind) in table.items():
        raw = env.get(name)
        if raw is None or (kind != "switch" and not raw.strip()):
            continue
        raw = raw.strip()
        if kind == "switch":  # lenient on/off: only the listed words turn it off
            changes[field] = raw.lower() not in _OFF
        elif kind == "names":  # comma-separated
            changes[field] = frozenset(n.strip() for n in raw.split(",") if n.strip())
        elif kind == "flag":
            if raw not in ("0", "1"):
                raise ValueError(f"{name} must be 0 or 1, got {raw!r}")
            changes[field] = raw == "1"
        else:
            try:
                changes[field] = int(raw)
            except ValueError:
                raise ValueError(f"{name} must be an integer, got {raw!r}") from None
    try:
        return cls(**changes)
    except (ValueError, TypeError) as e:
        prefix = f"{cls.__name__}."
        field = str(e).split(" ", 1)[0].removeprefix(prefix)
        name = table.get(field, (field,))[0]
        raise ValueError(str(e).replace(f"{prefix}{field}", name, 1)) from None


# field -> (environment name, kind): "switch" (on unless 0/false/no/off), "flag" (0 or 1),
# "int", "names" (comma-separated)
ENVIRONMENT: dict[str, tuple[str, str]] = {
    "enabled": ("VELOX_KERNELS", "switch"),
    "decode_warps": ("VELOX_DECODE_WARPS", "int"),
    "decode_unroll": ("VELOX_DECODE_UNROLL", "int"),
    "blocks": ("VELOX_DECODE_BLOCKS", "int"),
    "sms": ("VELOX_DECODE_SMS", "int"),
    "mma": ("VELOX_DECODE_MMA", "switch"),
    "symmetric": ("VELOX_DECODE_SYMMETRIC", "flag"),
    "mma_warps": ("VELOX_DECODE_MMA_WARPS", "int"),
    "mma_sm_blocks": ("VELOX_DECODE_MMA_SM_BLOCKS", "int"),
    "subtiles": ("VELOX_DECODE_SUBTILES", "int"),
    "stages": ("VELOX_DECODE_STAGES", "int"),
    "p_residual": ("VELOX_DECODE_P_RESIDUAL", "flag"),
    "pipeline": ("VELOX_DECODE_PIPELINE", "flag"),
    "value_fold": ("VELOX_DECODE_VFOLD", "flag"),
    "key_fold": ("VELOX_DECODE_KFOLD", "flag"),
    "ldsm": ("VELOX_DECODE_LDSM", "flag"),
    "fuse": ("VELOX_DECODE_FUSE", "flag"),
    "layouts_off": ("VELOX_LAYOUTS_OFF", "names"),
    "disk_cache": ("VELOX_KERNEL_CACHE", "switch"),
    "compile_ahead": ("VELOX_COMPILE_AHEAD", "switch"),
    "compile_processes": ("VELOX_COMPILE_PROCESSES", "switch"),
    "cuda_include": ("VELOX_CUDA_INCLUDE", "flag"),
    "latent_codes": ("VELOX_LATENT_CODES", "flag"),
}

_CURRENT: list[KernelConfig] = []  # the configuration in force (empty until first use)
# bumped by every configure(): what a decode plan was made under (cache/planned.py)
generation = 0

_PACKAGE: dict[type, Any] = {}  # a package's settings class -> the record in force
_PACKAGE_NAMES: dict[str, type] = {}  # a package's environment name -> its settings class


class PackageSettings:
    """The base of a method package's own kernel settings: a frozen dataclass whose fields
    are read, once, from the environment names in its ``ENVIRONMENT`` (field -> (name,
    kind), the kinds of :data:`ENVIRONMENT`), like :class:`KernelConfig`. A subclass checks
    its fields in ``__post_init__`` (messages starting with ``ClassName.field``, which the
    environment's name replaces) and is named to velox-core with :func:`register_settings`;
    :meth:`current` is the record in force, :meth:`configured` replaces it for a block."""

    ENVIRONMENT: ClassVar[dict[str, tuple[str, str]]] = {}

    @classmethod
    def from_environ(cls, environ: Mapping[str, str] | None = None) -> Any:
        """The defaults, overridden by the settings of ``environ`` (default ``os.environ``)."""
        return _from_environ(cls, cls.ENVIRONMENT, environ)

    @classmethod
    def current(cls) -> Any:
        """The record in force: the environment's, read on first use, or what
        :meth:`configured` set."""
        hit = _PACKAGE.get(cls)
        if hit is None:
            hit = _PACKAGE[cls] = cls.from_environ()
        return hit

    @classmethod
    @contextmanager
    def configured(cls, **changes: object) -> Iterator[Any]:
        """The record in force with ``changes``, for a ``with`` block."""
        old = cls.current()
        _PACKAGE[cls] = dataclasses.replace(old, **changes)
        try:
            yield _PACKAGE[cls]
        finally:
            _PACKAGE[cls] = old


def register_settings(cls: type[PackageSettings]) -> type[PackageSettings]:
    """Name a method package's settings class to velox-core (its environment names become
    kernel settings :func:`velox_testing.kernel_env` sets); usable as a decorator."""
    core = {n for n, _ in ENVIRONMENT.values()}
    for name, _ in cls.ENVIRONMENT.values():
        if name in core:
            raise ValueError(f"register_settings: {name} is velox-core's own setting")
        other = _PACKAGE_NAMES.get(name)
        if other is not None and other.__qualname__ != cls.__qualname__:
            raise ValueError(f"register_settings: {name} is {other.__name__}'s")
        _PACKAGE_NAMES[name] = cls
    return cls


def settings_of(name: str) -> type[PackageSettings] | None:
    """The settings class a package registered for environment name ``name``, or None."""
    return _PACKAGE_NAMES.get(name)


def kernel_config() -> KernelConfig:
    """The configuration in force: the environment's, read on first use, or what
    :func:`configure` set."""
    if not _CURRENT:
        _CURRENT.append(KernelConfig.from_environ())
    return _CURRENT[0]


def configure(config: KernelConfig | None = None, **changes: object) -> KernelConfig:
    """Put ``config`` (default: the one in force) with ``changes`` in force; returns the one
    it replaces. ``configure(KernelConfig.from_environ())`` re-reads the environment."""
    global generation
    old = kernel_config()
    new = (old if config is None else config).replace(**changes)
    _CURRENT[0] = new
    generation += 1
    return old


@contextmanager
def configured(config: KernelConfig | None = None, **changes: object) -> Iterator[KernelConfig]:
    """:func:`configure` for a ``with`` block, restoring the previous configuration after."""
    old = configure(config, **changes)
    try:
        yield kernel_config()
    finally:
        _CURRENT[0] = old
