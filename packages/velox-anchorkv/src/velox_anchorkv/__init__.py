"""velox-anchorkv: AnchorKV, anchor-residual KV cache compression (arXiv 2608.02901)."""

from velox_core import Method

from .anchors import choose_anchors, observe, project, residual_slots, utilities
from .cache import AnchorKVCache
from .codec import AnchorKeys, AnchorValues
from .compress import Compressed, compress_prompt
from .config import AnchorKVConfig
from .residual import ResidualCodec, gaussian_absmax

__all__ = [
    "METHOD",
    "AnchorKVCache",
    "AnchorKVConfig",
    "AnchorKeys",
    "AnchorValues",
    "Compressed",
    "ResidualCodec",
    "choose_anchors",
    "compress_prompt",
    "gaussian_absmax",
    "observe",
    "project",
    "residual_slots",
    "utilities",
]

METHOD = Method.of(
    AnchorKVCache,
    summary="prompt compressed once: exact anchors, every other token an anchor index and "
    "coefficient, 2-bit residuals by attention-output utility within a byte budget theta",
    paper="https://arxiv.org/abs/2608.02901",
    recommended=({"theta": 0.25},),
)
