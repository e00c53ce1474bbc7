"""velox-svdq: SVDq, pre-RoPE keys in their SVD latent channels with a precision that falls
with the singular value, low channels dropped (arXiv 2502.15304)."""

from velox_core import Method
from velox_core.ops.rope import RopeSpec, find_rope, rope_spec, rotate

from .cache import SVDqCache
from .codec import SVDqKeys, channel_widths
from .config import SVDqConfig, parse_schedule

__all__ = [
    "METHOD",
    "RopeSpec",
    "SVDqCache",
    "SVDqConfig",
    "SVDqKeys",
    "channel_widths",
    "find_rope",
    "parse_schedule",
    "rope_spec",
    "rotate",
]

METHOD = Method.of(
    SVDqCache,
    summary="pre-RoPE keys in SVD latent channels, mixed precision falling with the singular value",
    paper="https://arxiv.org/abs/2502.15304",
    codecs=(SVDqKeys,),
    # measured on the reference model at 4,096 tokens (docs/svdq.md): 3.75 and 2.75 bits per
    # latent channel with the mean removed, and the paper's worked example (2 bits) as it is
    recommended=(
        {"schedule": "8-8-4-4-2-2-1-1", "center": True},
        {"schedule": "8-4-2-1-1-0-0-0"},
    ),
)
