"""``AgeTieredCache``: KV precision by token age (a velox method; no paper).

Tokens lose precision as they age, in three tiers with two boundaries::

    sinks (fp16) | old (old_bits) | middle (middle_bits) | recent (recent_bits) | window (fp16)

It is a preset of velox-core's age tiers (``VeloxCache(tiers=[...])``): a token leaving the
fp16 window is coded at ``recent_bits``; when the recent tier holds more than ``recent``
tokens its oldest are decoded and re-coded once at ``middle_bits``; when the middle tier holds
more than ``middle``, its oldest are decoded and re-coded once at ``old_bits``. Every tier is
``velox_core.Uniform`` (affine codes, fp16 scale and zero per group, bit-packed). Keys are
coded per channel and values per token by default, as KIVI (arXiv 2402.02750) motivates: on
``velox_testing.kv_data`` per-channel keys at group 64 have 36-58% less attention error
than per-token keys at every width from 3 to 8 bits (docs/agetiered.md). Attention reads the
codes of every tier directly (``Uniform.scores`` / ``Uniform.mix``).

What follows from the mechanism:

- A token is coded once per tier it enters (at most three times), each time from the previous
  tier's decoded values: the originals are gone. Where the new grid nests in the old one
  (``2**b - 1`` divides ``2**a - 1``, i.e. ``b`` divides ``a``: 8 -> 4 -> 2, 6 -> 3, 6 -> 2)
  or the old one is fine (8 bits), the result is as good as coding the original directly.
  Other steps (4 -> 3, 5 -> 4, 3 -> 2) round grid points outward from the group's centre on
  average, which stretches the tier's keys and sharpens its attention: on kv_data 4 -> 3
  costs 27% more attention error than direct 3-bit codes. They are allowed; the recommended
  settings use nested widths only (8/6/3 and 8/4/2).
- Adjacent tiers of equal width are one tier (no re-coding where precision does not change).
- With per-channel groups tokens move in whole groups, so ``recent`` and ``middle`` must be
  multiples of ``group``. Which tokens share a group depends only on their positions, so the
  stored codes are the same for any chunking of the input (one prefill, token by token,
  uneven chunks).
- Trimming into a tier splits a group: velox-core returns its surviving tokens, decoded, to
  the fp16 window, and they are coded again as they age (the one case of a token being
  re-coded more than once per boundary).
"""

from __future__ import annotations

from typing import Any

from velox_core import PresetCache, Tier, Uniform

from .config import AgeTieredConfig

__all__ = ["AgeTieredCache"]


class AgeTieredCache(PresetCache):
    """KV codes whose precision falls with token age. Parameters: see :class:`AgeTieredConfig`."""

    method = "agetiered"
    Config = AgeTieredConfig

    def build(self, cfg: AgeTieredConfig) -> dict[str, Any]:
        tiers: list[tuple[int, int | None]] = []
        for bits, span in (
            (cfg.recent_bits, cfg.recent),
            (cfg.middle_bits, cfg.middle),
            (cfg.old_bits, None),
        ):
            if tiers and tiers[-1][0] == bits:  # same width: extend the tier, no re-coding
                prev = tiers[-1][1]
                tiers[-1] = (bits, None if span is None else prev + span)
            else:
                tiers.append((bits, span))
        return {
            "tiers": [
                Tier(
                    Uniform(bits, cfg.group, cfg.key_axis),
                    Uniform(bits, cfg.group, cfg.value_axis),
                    span,
                )
                for bits, span in tiers
            ],
        }
