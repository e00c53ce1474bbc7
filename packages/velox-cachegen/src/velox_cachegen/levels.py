"""Quality levels: how coarse each layer's quantization is.

CacheGen quantizes shallower layers more finely than deeper ones (arXiv 2310.07240, Sec. 5.1:
layer-wise quantization, the layers split into three groups), and streams each chunk at one
of several *levels* (Sec. 5.3). velox states both as step sizes. A chunk coded at level
``step`` quantizes layer ``i``'s keys with the step ``step * key[i] * sigma`` and its values
with ``step * value[i] * sigma``, where ``sigma`` is the root-mean-square of that chunk's
layer-side around its per-channel mean: the level is a step in units of the data's own
spread, and :class:`LayerSteps` holds the per-layer multipliers.

:meth:`LayerSteps.reference` is the public reference code's split (LMCache's CacheGen
configuration for 7B models: keys of the first third of the layers with 32 quantization bins
and the rest with 16, values of the first 2 of 32 layers with 32 bins and the rest with 16;
16 bins take about twice the step of 32). A model's measured multipliers
(:func:`velox_cachegen.fit_cachegen`) replace it where its layers' sensitivity differs: on
velox's reference model the *last* layer's keys are the most sensitive.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["LEVELS", "LayerSteps"]

LEVELS = (1.5, 2.0, 2.75, 4.0, 6.0)  # the default ladder a sender adapts over (finest first)


def _floats(name: str, v, n: int | None) -> tuple[float, ...]:
    try:
        out = tuple(float(x) for x in v)
    except (TypeError, ValueError):
        raise TypeError(f"layer_steps: {name} must be a sequence of numbers, got {v!r}") from None
    if not out or not all(math.isfinite(x) and x > 0 for x in out):
        raise ValueError(f"layer_steps: {name} must be positive finite numbers, got {v!r}")
    if n is not None and len(out) != n:
        raise ValueError(f"layer_steps: {name} has {len(out)} entries for {n} layers")
    return out


@dataclass(frozen=True)
class LayerSteps:
    """Per-layer step multipliers for keys and values (module docstring)."""

    key: tuple[float, ...]
    value: tuple[float, ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "key", _floats("key", self.key, None))
        object.__setattr__(self, "value", _floats("value", self.value, len(self.key)))

    @staticmethod
    def reference(layers: int) -> LayerSteps:
        """The public reference code's layer groups for a model of ``layers`` layers."""
        if layers < 1:
            raise ValueError(f"layer_steps: a model has at least one layer, got {layers}")
        key_fine = max(1, layers // 3)
        value_fine = max(1, round(layers * 2 / 32))
        return LayerSteps(
            tuple(1.0 if i < key_fine else 2.0 for i in range(layers)),
            tuple(1.0 if i < value_fine else 2.0 for i in range(layers)),
        )

    def sides(self) -> list[float]:
        """Multipliers in layer-side order: layer 0's keys, layer 0's values, layer 1's..."""
        return [m for pair in zip(self.key, self.value) for m in pair]

    def to_json(self) -> dict[str, list[float]]:
        return {"key": list(self.key), "value": list(self.value)}
