"""TurboQuant's code records for the decode kernels: its own outlier layout, and its integer
codes as velox-core's codebook records with their outlier view.

* :class:`OutlierCodes`: a side of the outlier kernel (:mod:`velox_turboquant.outlier`): a
  fractional width's two rotated parts with their per-group mask, or an integer width's one
  part beside a fractional side. Its layout (:class:`OutlierLayout`) brings the kernel of its
  own (:meth:`OutlierLayout.own_kernel`); the split partials go to velox-core's merge kernels.
* :class:`TurboCodebookCodes`: an integer-width mse side as velox-core's
  :class:`~velox_core.kernels.records.CodebookCodes` (the codebook kernels read it), carrying
  the same codes as the outlier kernel reads a side of one part, for fractional keys beside
  integer values.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import mlx.core as mx

from velox_core.kernels.layout import Layout, register_layout
from velox_core.kernels.records import CodebookCodes, CodeRecord

from .outlier import OutlierSide, outlier_parts

__all__ = ["OUTLIER_KIND", "OutlierCodes", "OutlierLayout", "TurboCodebookCodes"]

OUTLIER_KIND = 7  # the layout's kind (it never reaches the portable kernel: own kernel)


@dataclass(slots=True, kw_only=True)
class OutlierCodes(CodeRecord):
    """One side of a segment as the outlier kernel reads it (:class:`OutlierSide`)."""

    kind: ClassVar[int] = OUTLIER_KIND
    side: OutlierSide

    @property
    def codes(self) -> mx.array:
        return self.side.codes[-1]

    @property
    def bits(self) -> int:
        return self.side.parts[-1].bits

    @property
    def group(self) -> int:
        return self.side.group

    @property
    def a(self) -> mx.array:
        return self.side.norms[-1]


@dataclass(slots=True, kw_only=True)
class TurboCodebookCodes(CodebookCodes):
    """An integer-width mse side as codebook codes, with ``outlier``: the same codes as the
    outlier kernel reads a side of one part (None where that kernel does not apply: a Haar
    rotation)."""

    outlier: OutlierSide | None = None


class OutlierLayout(Layout):
    """How the decode kernels read :class:`OutlierCodes`: by the outlier kernel only (keys
    and values both of this layout)."""

    kind = OUTLIER_KIND
    record = OutlierCodes
    name = "outlier"
    mixes_values = False
    package = "velox_turboquant"

    def lanes_ok(self, bits, group, dim, cpl):
        return False  # never the portable kernel's own passes

    def own_kernel(self, q_shape, keys, values, splits, scale):
        if not isinstance(values, OutlierCodes):
            raise ValueError(
                f"decode_attention: outlier keys need outlier values, got {type(values).__name__}"
            )
        parts = outlier_parts(q_shape, keys.side, values.side, splits, scale)
        if parts is None:
            raise ValueError(
                f"decode_attention: the outlier kernel has no layout for query rows {q_shape[2]} "
                "and these sides (outlier_launch)"
            )
        return parts


register_layout(OutlierLayout())
