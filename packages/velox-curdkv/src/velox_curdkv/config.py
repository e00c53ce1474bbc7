"""Settings of the CurDKV cache."""

from __future__ import annotations

from dataclasses import dataclass

from velox_core.cache.eviction import EvictionConfig
from velox_core.validation import check_int


@dataclass
class CurDKVConfig(EvictionConfig):
    """CurDKV (arXiv 2509.15038) settings: the shared eviction settings
    (:class:`~velox_core.cache.eviction.EvictionConfig`), with CurDKV's own.

    Attributes:
        budget: tokens kept per KV head: sinks, the highest-leverage body tokens and the
            window.
        sinks: first tokens always kept (4: the reference code's ``num_sinks``).
        window: most recent tokens always kept (0: the paper keeps none by rule).
        every: during decode, cut back to ``budget`` once it is exceeded by ``every`` tokens
            (None: the paper's prompt-only compression; generated tokens accumulate).
        bits, key_bits, value_bits, group: ``Uniform`` codes of the kept tokens (None: fp16).
        sketch: columns ``r`` of the Gaussian projection of keys and values (20, as the
            reference code; 0: the exact squared norms).
        local: positions per window of the local normalisation of the scores (16, as the
            reference code; 0: one window, the whole context).
        seed: seed of the projection (one ``G`` per cache).
    """

    sinks: int = 4
    sketch: int = 20
    local: int = 16
    seed: int = 0

    def __post_init__(self):
        super().__post_init__()
        check_int("sketch", self.sketch, minimum=0)
        check_int("local", self.local, minimum=0)
        if self.local == 1:
            raise ValueError("local must be 0 (the whole context) or >= 2, got 1")
        check_int("seed", self.seed, minimum=0)
