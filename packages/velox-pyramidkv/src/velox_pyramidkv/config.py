"""Settings of the PyramidKV cache."""

from __future__ import annotations

import math
from dataclasses import dataclass

from velox_core.cache.eviction import EvictionConfig
from velox_core.policy import WindowVote
from velox_core.validation import check_float, check_int


def check_beta(beta) -> float:
    """The pyramid's steepness: a finite number >= 1 (1: every layer the same budget)."""
    value = check_float("beta", beta, minimum=1.0)
    if not math.isfinite(value):
        raise ValueError(f"beta must be a finite number >= 1, got {value}")
    return value


def check_place(layer, n_layers) -> tuple[int | None, int | None]:
    """A layer's place in the pyramid: both None (unknown until ``make_cache`` binds the
    cache to a model layer) or ``0 <= layer < n_layers``."""
    if (layer is None) != (n_layers is None):
        raise ValueError(
            f"layer and n_layers go together (the layer's place in a pyramid of n_layers), "
            f"got layer={layer!r}, n_layers={n_layers!r}; give both, or neither and make the "
            "caches with velox_core.make_cache(model, ...)"
        )
    if layer is None:
        return None, None
    check_int("n_layers", n_layers, minimum=1)
    check_int("layer", layer, minimum=0, maximum=n_layers - 1)
    return layer, n_layers


@dataclass
class PyramidKVConfig(EvictionConfig):
    """PyramidKV (arXiv 2406.02069) settings, with the shared parameter names
    (:class:`~velox_core.cache.eviction.EvictionConfig`).

    Attributes:
        budget: tokens kept per KV head, **averaged over the layers** (sinks, voted prompt
            tokens and the observation window): the whole model keeps ``n_layers x budget``,
            bottom layers more, top layers fewer (the paper's ``max_capacity_prompt``).
        sinks: first tokens always kept, in every layer (not in the paper; 0 by default).
        every: during decode, cut a layer again once it exceeds its budget by ``every``
            tokens (None: the paper, which compresses the prompt only).
        observe: the observation window: how many of the newest queries vote, and how many
            of the newest tokens every layer always keeps (the paper's ``window_size``, 32).
        kernel: odd pooling kernel along tokens (the paper's experiments use 7; 1 = none).
        pooling: ``"max"`` (the paper's experiments) or ``"avg"`` (its code's default).
        beta: the pyramid's steepness: the top layer selects ``1 / beta`` of the average
            share of voted tokens, the bottom one ``2 - 1 / beta`` of it (20, the paper's
            and kvpress's default; 1 is a uniform budget, i.e. SnapKV).
        layer, n_layers: this cache's place in the pyramid (0 = the bottom layer, which
            keeps the most). ``velox_core.make_cache(model, ...)`` sets them (the model's
            layers that hold a PyramidKV cache, in order); give them only for a cache made
            without a model.
    """

    observe: int = 32
    kernel: int = 7
    pooling: str = "max"
    beta: float = 20.0
    layer: int | None = None
    n_layers: int | None = None

    def __post_init__(self):
        super().__post_init__()
        WindowVote(self.observe, self.kernel, self.pooling)  # raises on a bad setting
        self.beta = check_beta(self.beta)
        check_place(self.layer, self.n_layers)
        if self.budget <= self.sinks + max(self.window, self.observe):
            raise ValueError(
                f"budget={self.budget} must exceed sinks + max(window, observe) = "
                f"{self.sinks + max(self.window, self.observe)} (every layer keeps those "
                "tokens; the pyramid shares out the rest)"
            )
