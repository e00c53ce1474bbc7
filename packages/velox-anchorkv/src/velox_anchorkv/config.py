"""Settings of the AnchorKV cache."""

from __future__ import annotations

from dataclasses import dataclass

from velox_core import CodeWidths
from velox_core.codec.prerope import check_rope_settings, rope_fields, rope_settings
from velox_core.validation import check_float, check_int, check_widths

ANCHORS = 1 / 128  # anchors per prompt token (the paper's k = S / 128)


@dataclass
@rope_fields
class AnchorKVConfig(CodeWidths):
    """AnchorKV (arXiv 2608.02901) settings, with the shared parameter names.

    Attributes:
        bits: code width of the residuals, keys and values (the paper: 2; 1 to 8 allowed).
        key_bits, value_bits: either side alone (default ``bits``).
        theta: the byte budget, a share of the prompt's fp16 keys and values (the paper's
            ``θ``, in (0, 1]): anchors and per-token metadata are charged first, residuals
            buy what remains (Eq. 9). A prompt too short for its anchors and metadata holds
            more than ``theta`` (no residual then).
        window: ``W``, the newest prompt tokens kept exactly as anchors; its queries are the
            observation window that scores anchors and residuals.
        anchors: anchors per prompt token, window included (``k = max(W, ⌊anchors·S⌋)``;
            the paper's ``S / 128``).
        rho: share of the anchors past the window chosen by SnapKV's votes of the
            observation window (the rest uniformly at random).
        seed: seed of the random anchors and of the residuals' Hadamard rotation.
        rope_base, rope_traditional, rope_scale, rope_dims: the RoPE of a standalone cache,
            unset with a model (:mod:`velox_core.codec.prerope`); keys are projected before RoPE.
    """

    bits: int = 2
    theta: float = 0.25
    window: int = 32
    anchors: float = ANCHORS
    rho: float = 0.5
    seed: int = 0

    def __post_init__(self):
        check_widths(self, minimum=1, maximum=8, bits_required=True)
        check_float("theta", self.theta, minimum=0.0, maximum=1.0, open_min=True)
        check_int("window", self.window, minimum=1)
        check_float("anchors", self.anchors, minimum=0.0, maximum=1.0)
        check_float("rho", self.rho, minimum=0.0, maximum=1.0)
        check_int("seed", self.seed, minimum=0)
        check_rope_settings(**rope_settings(self))

    def check_dims(self, key_dim: int, value_dim: int) -> None:
        """The residuals' Hadamard rotation needs even head dims."""
        for side, dim in (("key", key_dim), ("value", value_dim)):
            if dim % 2:
                raise ValueError(
                    f"anchorkv: the {side} head dim {dim} is odd; its residuals' Hadamard "
                    "rotation needs an even head dim"
                )
