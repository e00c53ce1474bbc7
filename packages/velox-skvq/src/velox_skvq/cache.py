"""``SKVQCache``: SKVQ codes for old tokens, an fp16 sliding window and fp16 attention sinks.

SKVQ (arXiv 2405.06219) keeps the most recent ``window`` tokens and the first ``sinks`` tokens
in fp16 and codes every other token with :class:`~velox_skvq.SKVQ` (reordered channels,
clipped dynamic group quantization), keys and values with their own widths. The codecs are
fitted on the first tokens the cache sees: when the first token leaves the window, every token
stored so far except the sinks (which are never coded) calibrates the permutation and the
clipping factors of each sequence. The paper calibrates once per model, offline.

Batching: each sequence has its own fitted state, so ``filter`` / ``extend`` (and ``extract``
/ ``merge``) carry the codecs' rows along with the stored tokens.
"""

from __future__ import annotations

import mlx.core as mx

from velox_core import Codec, PresetCache

from .codec import SKVQ
from .config import SKVQConfig

__all__ = ["SKVQCache"]


class SKVQCache(PresetCache):
    """SKVQ's cache for one layer. Parameters: see :class:`SKVQConfig`."""

    method = "skvq"
    # calibration decides in the window when coding starts: tokens leave it one at a time
    default_flush = 1
    Config = SKVQConfig

    # why a model split by heads cannot use it (VeloxCache.split_refusal)
    mixes_heads = "its channel reordering permutes the channels of all the layer's heads together"

    def make_codecs(self, cfg: SKVQConfig, kb: int | float, vb: int | float) -> tuple[Codec, Codec]:
        kg = cfg.group if cfg.key_group is None else cfg.key_group
        vg = cfg.group if cfg.value_group is None else cfg.value_group
        return SKVQ(kb, kg, cfg.clip_min, cfg.reorder), SKVQ(vb, vg, cfg.clip_min, cfg.reorder)

    def _codecs_skvq(self) -> list[SKVQ]:
        return [c for c in self._codecs() if isinstance(c, SKVQ)]

    def before_coding(self) -> bool:
        """Fit the codecs on every non-sink token stored, just before the first is coded."""
        tier = self.tiers[0]
        if not tier.key_codec.fitted and self.stored.window[0].tokens > self.window:
            k, v = self.stored.window[0].view(), self.stored.window[1].view()
            tier.key_codec.fit(k.data["x"])
            tier.value_codec.fit(v.data["x"])
        return True

    def filter(self, batch_indices) -> None:
        idx = mx.array(batch_indices) if not isinstance(batch_indices, mx.array) else batch_indices
        super().filter(idx)
        for c in self._codecs_skvq():
            c.select_rows(idx)

    def extend(self, other: SKVQCache) -> None:
        if isinstance(other, SKVQCache):
            for mine, theirs in zip(self._codecs_skvq(), other._codecs_skvq()):
                if mine.fitted != theirs.fitted:
                    raise ValueError("extend: one cache has fitted SKVQ codecs and the other not")
        super().extend(other)
        for mine, theirs in zip(self._codecs_skvq(), other._codecs_skvq()):
            mine.append_rows(theirs)
