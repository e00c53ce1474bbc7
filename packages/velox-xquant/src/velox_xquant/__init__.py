"""velox-xquant: XQuant, ultra-low-bit KV codes with data-free calibration and cross-layer code
reuse between adjacent layers (arXiv 2510.11236)."""

from velox_core import Method

from .cache import XQuantCache
from .codec import ETA_DEFAULT, XQuantCodes, default_eta
from .config import XQuantConfig
from .pair import XQuantPair

__all__ = [
    "ETA_DEFAULT",
    "METHOD",
    "XQuantCache",
    "XQuantCodes",
    "XQuantConfig",
    "XQuantPair",
    "default_eta",
]

METHOD = Method.of(
    XQuantCache,
    summary="KIVI-style 1/2-bit codes with calibrated zero-points and scales; each odd layer "
    "reads its lower neighbour's codes with its own scales (cross-layer pairs)",
    paper="https://arxiv.org/abs/2510.11236",
    codecs=(XQuantCodes,),
    recommended=(
        {"bits": 2},
        {"bits": 2, "share_from": None},
        {"bits": 4, "group": 128, "window": 0, "share_from": None},
    ),
)
