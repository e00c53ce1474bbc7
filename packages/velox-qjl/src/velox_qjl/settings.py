"""QJL's kernel settings, read from the environment once, and the kernels' kind of sketch keys
(their own module: :mod:`velox_qjl.layout` and :mod:`velox_qjl.sketch_mma` both read them)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from velox_core.kernels.config import PackageSettings, register_settings

__all__ = ["SKETCH", "QJLKernelConfig"]

SKETCH = 3  # the kernel's KKIND of sketch keys


@register_settings
@dataclass(frozen=True)
class QJLKernelConfig(PackageSettings):
    """The settings of QJL's kernels, read from the environment once
    (``QJLKernelConfig.current()``; ``QJLKernelConfig.configured(...)`` for a block).

    Attributes:
        lanes: most lanes per token of the portable kernel's key pass (1 to 32, a power of
            2; ``VELOX_DECODE_SKETCH_LANES``).
        mma_lo: the tensor-core kernel takes the sketched query as fp16 plus its residual
            (False: fp16 only; ``VELOX_SKETCH_MMA_LO``).
        mma_diff / mma_bsm: force the tensor-core kernel's ``DIFF`` / ``BSM`` layouts on or
            off (None: chosen per layout; ``VELOX_SKETCH_MMA_DIFF`` / ``_BSM``).
        mma_ahead: tiles it loads ahead (1, 2; None: per layout; ``VELOX_SKETCH_MMA_AHEAD``).
    """

    ENVIRONMENT: ClassVar[dict[str, tuple[str, str]]] = {
        "lanes": ("VELOX_DECODE_SKETCH_LANES", "int"),
        "mma_lo": ("VELOX_SKETCH_MMA_LO", "switch"),
        "mma_diff": ("VELOX_SKETCH_MMA_DIFF", "flag"),
        "mma_bsm": ("VELOX_SKETCH_MMA_BSM", "flag"),
        "mma_ahead": ("VELOX_SKETCH_MMA_AHEAD", "int"),
    }
    lanes: int = 32
    mma_lo: bool = True
    mma_diff: bool | None = None
    mma_bsm: bool | None = None
    mma_ahead: int | None = None

    def __post_init__(self) -> None:
        if self.lanes not in (1, 2, 4, 8, 16, 32):
            raise ValueError(
                f"QJLKernelConfig.lanes must be one of 1, 2, 4, 8, 16, 32, got {self.lanes!r}"
            )
        if self.mma_ahead not in (None, 1, 2):
            raise ValueError(
                f"QJLKernelConfig.mma_ahead must be one of 1, 2, got {self.mma_ahead!r}"
            )
        for name in ("mma_lo", "mma_diff", "mma_bsm"):
            v = getattr(self, name)
            if not isinstance(v, bool) and not (v is None and name != "mma_lo"):
                raise TypeError(f"QJLKernelConfig.{name} must be True or False, got {v!r}")
