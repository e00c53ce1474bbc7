"""The kernels' configuration: one typed, frozen record, read once.

Every kernel variant and tuning knob is a field of :class:`KernelConfig`, with its default.
The configuration in force is :func:`kernel_config` (built from the environment on first
use, then kept); :func:`configure` replaces it for the process and :func:`configured` for a
``with`` block (tests, benchmarks comparing variants). Nothing on the hot path reads the
environment: plans are keyed on the configuration record itself.

The environment is read once, at first use, for these names (each a field below):
``VELOX_KERNELS=0`` turns every kernel off (reference MLX everywhere; the one switch meant
for users); the ``VELOX_DECODE_*`` and ``VELOX_SKETCH_MMA_*`` settings tune the kernels on a
new GPU (docs/architecture.md lists them). A method package's own kernel settings live in
that package, read the same way; it names them with :func:`register_settings`. A field left at
``None`` takes the rule its accessor documents (e.g. the tensor-core kernel's split count
from the device's SM count).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

__all__ = [
    "ENVIRONMENT",
    "KernelConfig",
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
        sketch_lanes: most lanes per token of the sketch keys' pass (1 to 32, a power of 2).
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
        p_residual: carry the softmax weights' fp16 rounding residual (a second value MMA).
        pipeline: score the next step before consuming the current one.
        value_fold / key_fold: fold the value / key scales out of the MMAs where they can.
        ldsm: read code words out of the ring with ldmatrix.
        fuse: the tensor-core kernel merges its own splits (None: up to 16,384 tokens).
        sketch_mma_lo: the sketched query as fp16 plus its residual (False: fp16 only).
        sketch_mma_diff / sketch_mma_bsm: force the sketch kernel's ``DIFF`` / ``BSM``
            layouts on or off (None: chosen per layout).
        sketch_mma_ahead: tiles loaded ahead by the sketch kernel (1, 2; None: per layout).
        layouts_off: names of code layouts the kernels decline
            (:mod:`velox_core.kernels.layout`; e.g. ``{"vq"}``): their segments take the
            reference path.
        disk_cache: on CUDA, compile each kernel into MLX's PTX disk cache, so that later
            processes load it instead of compiling it (:mod:`velox_core.kernels.disk_cache`).
        cuda_include: on CUDA, hand MLX each kernel's texts as ``#include`` lines of files
            holding them, which shortens MLX's work per call
            (:meth:`velox_core.kernels.build.KernelSpec.mlx_texts`).
    """

    enabled: bool = True
    decode_warps: int = 4
    decode_unroll: int = 4
    sketch_lanes: int = 32
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
    sketch_mma_lo: bool = True
    sketch_mma_diff: bool | None = None
    sketch_mma_bsm: bool | None = None
    sketch_mma_ahead: int | None = None
    layouts_off: frozenset[str] = frozenset()
    disk_cache: bool = True
    cuda_include: bool = True

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if f.type in ("bool", "bool | None") and not (
                isinstance(v, bool) or (v is None and "None" in f.type)
            ):
                raise TypeError(f"KernelConfig.{f.name} must be True or False, got {v!r}")
        _choice("KernelConfig.decode_warps", self.decode_warps, (1, 2, 4, 8))
        _range("KernelConfig.decode_unroll", self.decode_unroll, 1, 16)
        _choice("KernelConfig.sketch_lanes", self.sketch_lanes, (1, 2, 4, 8, 16, 32))
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
        if self.sketch_mma_ahead is not None:
            _choice("KernelConfig.sketch_mma_ahead", self.sketch_mma_ahead, (1, 2))
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
        env = os.environ if environ is None else environ
        changes: dict[str, object] = {}
        for field, (name, kind) in ENVIRONMENT.items():
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
            return KernelConfig(**changes)
        except (ValueError, TypeError) as e:
            field = str(e).split(" ", 1)[0].removeprefix("KernelConfig.")
            name = ENVIRONMENT.get(field, (field,))[0]
            raise ValueError(str(e).replace(f"KernelConfig.{field}", name, 1)) from None


# field -> (environment name, kind): "switch" (on unless 0/false/no/off), "flag" (0 or 1),
# "int", "names" (comma-separated)
ENVIRONMENT: dict[str, tuple[str, str]] = {
    "enabled": ("VELOX_KERNELS", "switch"),
    "decode_warps": ("VELOX_DECODE_WARPS", "int"),
    "decode_unroll": ("VELOX_DECODE_UNROLL", "int"),
    "sketch_lanes": ("VELOX_DECODE_SKETCH_LANES", "int"),
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
    "sketch_mma_lo": ("VELOX_SKETCH_MMA_LO", "switch"),
    "sketch_mma_diff": ("VELOX_SKETCH_MMA_DIFF", "flag"),
    "sketch_mma_bsm": ("VELOX_SKETCH_MMA_BSM", "flag"),
    "sketch_mma_ahead": ("VELOX_SKETCH_MMA_AHEAD", "int"),
    "layouts_off": ("VELOX_LAYOUTS_OFF", "names"),
    "disk_cache": ("VELOX_KERNEL_CACHE", "switch"),
    "cuda_include": ("VELOX_CUDA_INCLUDE", "flag"),
}

_CURRENT: list[KernelConfig] = []  # the configuration in force (empty until first use)

# a method package's own setting -> (its module, which holds the record in force in its
# _CURRENT list, and the function reading the record from the environment)
_PACKAGE_SETTINGS: dict[str, tuple[Any, Callable[[], Any]]] = {}


def register_settings(names: Iterable[str], module: Any, read: Callable[[], Any]) -> None:
    """Name a method package's own kernel settings (``VELOX_*`` environment names): its
    ``module`` keeps the record in force in ``module._CURRENT`` and ``read()`` builds it
    from the environment (what :func:`velox_core.testing.kernel_env` re-reads in a test)."""
    for name in names:
        if name in {n for n, _ in ENVIRONMENT.values()}:
            raise ValueError(f"register_settings: {name} is velox-core's own setting")
        _PACKAGE_SETTINGS[name] = (module, read)


def settings_of(name: str) -> tuple[Any, Callable[[], Any]] | None:
    """``(module, read)`` of a package's setting :func:`register_settings` named, or None."""
    return _PACKAGE_SETTINGS.get(name)


def kernel_config() -> KernelConfig:
    """The configuration in force: the environment's, read on first use, or what
    :func:`configure` set."""
    if not _CURRENT:
        _CURRENT.append(KernelConfig.from_environ())
    return _CURRENT[0]


def configure(config: KernelConfig | None = None, **changes: object) -> KernelConfig:
    """Put ``config`` (default: the one in force) with ``changes`` in force; returns the one
    it replaces. ``configure(KernelConfig.from_environ())`` re-reads the environment."""
    old = kernel_config()
    new = (old if config is None else config).replace(**changes)
    _CURRENT[0] = new
    return old


@contextmanager
def configured(config: KernelConfig | None = None, **changes: object) -> Iterator[KernelConfig]:
    """:func:`configure` for a ``with`` block, restoring the previous configuration after."""
    old = configure(config, **changes)
    try:
        yield kernel_config()
    finally:
        _CURRENT[0] = old
