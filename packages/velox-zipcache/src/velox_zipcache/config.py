"""Settings of the ZipCache cache."""

from __future__ import annotations

from dataclasses import dataclass

from velox_core import CodeWidths
from velox_core.validation import (
    check_bits,
    check_choice,
    check_counts,
    check_float,
    check_int,
    check_widths,
)

__all__ = ["KEY_AXES", "SCORES", "ZipCacheConfig"]

# how keys are quantized: channelwise (the authors' code) or channel-separable tokenwise (the
# values' scheme)
KEY_AXES = ("channel", "token")

# what ranks a block's tokens: the paper's metric and the two it is compared with (Table A)
SCORES = ("normalized", "accumulated", "locality")


@dataclass
class ZipCacheConfig(CodeWidths):
    """ZipCache (arXiv 2405.14256) settings, with the shared parameter names.

    Attributes:
        bits: code width of the salient tokens, keys and values (the paper's high width, 4).
        key_bits, value_bits: either side's salient width alone (default ``bits``).
        low_bits: code width of the other tokens (the paper's low width, 2); 1 to the
            salient widths.
        salient: fraction of each block's tokens coded at ``bits``, in ``[0, 1]`` (the
            paper's saliency ratio; the authors' released setting: 0.6, their study of probe
            strategies: 0.4).
        score: what ranks a block's tokens: ``"normalized"`` (the paper's normalized
            attention score), ``"accumulated"`` (the probes' attention summed, not divided by
            the probes that see each token: H2O's metric) or ``"locality"`` (the newest
            tokens of each block, no attention): the paper's Table A compares the three.
        probes: fraction of a multi-token call's queries whose attention scores the tokens,
            in ``(0, 1]``: half the newest queries, half drawn at random from the others
            (the paper: 10%, 5% each way; 1.0 scores with every query).
        group: tokens per block (the authors' streaming interval, 100): tokens are coded a
            block at a time, each block with exactly ``salient`` of its tokens salient and
            its own quantization parameters; decode tokens wait in fp16 until a block is
            whole.
        key_axis: ``"channel"`` (keys quantized per channel, the authors' code) or
            ``"token"`` (channel-separable tokenwise, as the values).
        window: newest tokens kept in fp16 (0, as the paper).
        sinks: first tokens kept in fp16 (0, as the paper).
        seed: seed of the random probes.
    """

    bits: int = 4
    low_bits: int = 2
    salient: float = 0.6
    score: str = "normalized"
    probes: float = 0.1
    group: int = 100
    key_axis: str = "channel"
    window: int = 0
    sinks: int = 0
    seed: int = 0

    def __post_init__(self):
        check_widths(self, bits_required=True)
        check_bits("low_bits", self.low_bits, minimum=1, maximum=8)
        high = min(self.widths)
        if self.low_bits > high:
            raise ValueError(
                f"zipcache: low_bits must be at most the salient tokens' widths (bits, "
                f"key_bits, value_bits: here {high}), got low_bits={self.low_bits}"
            )
        check_float("salient", self.salient, minimum=0.0, maximum=1.0)
        check_choice("score", self.score, SCORES)
        check_float("probes", self.probes, minimum=0.0, maximum=1.0, open_min=True)
        check_int("group", self.group, minimum=1)
        check_choice("key_axis", self.key_axis, KEY_AXES)
        check_counts(self, "window", "sinks", "seed")
