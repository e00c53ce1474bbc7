"""``OscarCache``: OSCAR's rotated, clipped INT2 keys and values (arXiv 2605.17757), with the
paper's exact sinks and recent window, as a velox preset.

The cache keeps three segments (the paper's logical cache ``[1, S0] | [S0+1, t-W] |
[t-W+1, t]``): the first ``sinks`` tokens exact, the body coded by
:class:`~velox_oscar.codec.OscarKeys` and :class:`~velox_oscar.codec.OscarValues`, and the
newest ``window`` tokens exact; tokens leave the window for the codes ``flush`` at a time
(velox's default 64: between ``window`` and ``window + 63`` of the newest tokens are exact).
Attention over the three is one softmax (velox-core's log-sum-exp merge), as the paper's two
first-stage kernels and their merge. The rotations and clip ratios are found when
``velox_core.make_cache`` binds the cache to its model and layer.

Deviations from the paper and the authors' code (also in docs/oscar.md): the exact tokens are
kept in the model's dtype (the paper: BF16); the clip ratio is fitted per layer and side on
the calibration data (the authors' serving scripts pass one ratio per side for the whole
model: keys 0.96, values 0.92, which ``key_clip``/``value_clip`` reproduce); scales and
minimums are fp16 (bf16 for bf16 models), and the value rotation is applied to the mixed
output rather than folded into the output projection (velox leaves the model's weights as
they are). ``centre=True`` (off by default, not in the paper) codes each key less its KV
head's fitted mean key. ``keys="channel"`` (not in the paper either) codes the keys as KIVI
does, per channel in groups of ``key_group`` tokens (``velox_core.Uniform(axis="channel")``:
no key rotation, no key clip), beside OSCAR's rotated values: on Gemma 3 per-token key codes
cannot hold the keys at 2 bits, KIVI's per-channel ones can (docs/oscar.md).
"""

from __future__ import annotations

from velox_core import Codec, PresetCache, Uniform, config_fields
from velox_core.cache.velox import FITTED_ON_WHOLE_MODEL

from .codec import OscarKeys, OscarValues
from .config import OscarConfig

__all__ = ["OscarCache"]


class OscarCache(PresetCache):
    """OSCAR's cache for one layer. Parameters: see :class:`OscarConfig`."""

    method = "oscar"
    Config = OscarConfig

    fitted_on_whole_model = True  # its artifact: a split model is refused

    @classmethod
    def split_refusal(cls, config: dict, by_heads: bool, pipelined: bool) -> str:
        """A fitted artifact is found by the whole model's fingerprint: any split is refused,
        except the data-free ablation (``rotation="hadamard"`` with both clips given), whose
        per-head codes split by heads or by stages."""
        cfg = OscarConfig(**{k: v for k, v in config.items() if k not in ("flush", "check_finite")})
        return FITTED_ON_WHOLE_MODEL if cfg.needs_artifact else ""

    def make_codecs(self, cfg: OscarConfig, kb: int, vb: int) -> tuple[Codec, Codec]:
        common = config_fields(cfg, "group", "rotation", "artifact", "layer")
        values = OscarValues(vb, clip=cfg.value_clip, **common)
        if cfg.keys == "channel":  # KIVI's per-channel keys, velox-core's codec
            return Uniform(kb, cfg.channel_group, axis="channel"), values
        return OscarKeys(kb, clip=cfg.key_clip, centre=cfg.centre, **common), values
