"""Settings of the Kitty cache."""

from __future__ import annotations

from dataclasses import dataclass

from velox_core import CodeWidths
from velox_core.validation import (
    check_bits,
    check_choice,
    check_counts,
    check_divides,
    check_float,
    check_int,
    check_widths,
)

from .codec import SCORES


@dataclass
class KittyConfig(CodeWidths):
    """Kitty (arXiv 2511.18643) settings, with the shared parameter names.

    Attributes:
        bits: code width of the keys' unboosted channels and of the values (the paper: 2).
        key_bits, value_bits: either side alone (default ``bits``).
        boost_bits: code width of the boosted key channels (the paper: 4); above the keys'
            width, at most 8.
        boost: fraction of each page's key channels boosted, in ``[0, 1]`` (the paper's
            system: 0.25, a quarter of the head dim; its accuracy runs: 0.2). ``int(D *
            boost)`` channels per page and KV head.
        score: how a page's channels are ranked: ``"magnitude"`` (mean ``|k|`` over the page,
            the paper's system) or ``"variance"`` (variance over the page).
        group: tokens per key page (the paper's page of 128); each channel of a page has an
            fp16 scale and minimum.
        value_group: channels per value group (values are quantized per token); None, the
            default, is the value head dim: the paper groups a token's whole head (128
            channels on its models).
        window: most recent tokens kept in fp16 (the paper's 128-token local buffer).
        sinks: first tokens kept in fp16 (the paper's 32 sink tokens).
    """

    bits: int = 2
    boost_bits: int = 4
    boost: float = 0.25
    score: str = "magnitude"
    group: int = 128
    value_group: int | None = None
    window: int = 128
    sinks: int = 32

    def __post_init__(self):
        check_widths(self, bits_required=True)
        kb = self.widths[0]
        check_bits("boost_bits", self.boost_bits, minimum=2, maximum=8)
        if self.boost_bits <= kb:
            raise ValueError(
                f"kitty: boost_bits must be above the keys' width {kb} (key_bits, default "
                f"bits) and at most 8, got boost_bits={self.boost_bits}"
            )
        check_float("boost", self.boost, minimum=0.0, maximum=1.0)
        check_choice("score", self.score, SCORES)
        check_int("group", self.group, minimum=1)
        if self.value_group is not None:
            check_int("value_group", self.value_group, minimum=1)
        check_counts(self, "window", "sinks")

    def check_dims(self, key_dim: int, value_dim: int) -> None:
        """Values are quantized per token in groups of ``value_group`` channels, so it must
        divide the value head dim; key pages run along tokens (any head dim up to 256)."""
        why = "values are quantized per token in groups of `value_group` channels"
        if self.value_group is not None:
            check_divides(
                "kitty", "value_group", self.value_group, value_dim, "value head dim", why
            )
        if key_dim > 256:
            raise ValueError(
                f"kitty: key head dim {key_dim} exceeds 256 (channel indices are uint8)"
            )
