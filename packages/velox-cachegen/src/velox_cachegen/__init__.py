"""CacheGen for velox (arXiv 2310.07240): KV caches at rest and on the wire, as anchor and
delta codes quantized layer by layer and range coded under per-channel frequency tables, in
chunks that decode alone and can each take their own quality level.

:func:`save` / :func:`load` write and read such caches as files, :func:`encode` /
:func:`decode` as bytes (to hand a cache to another process); :func:`encode_levels` codes
every chunk at every level of a ladder and :func:`choose_levels` picks each chunk's level for
a bandwidth and a deadline, as CacheGen's streamer does. Loading rebuilds caches of the saved
classes (mlx-lm ``KVCache``, velox caches) that continue decoding. :func:`fit_cachegen`
measures a model's layer steps (``python -m velox_cachegen fit``).
"""

from .artifact import HOW_TO_FIT, LayerProfile, fit_cachegen, load_profile, save_profile
from .levels import LEVELS, LayerSteps
from .load import decode, inspect, load
from .store import (
    ANCHOR_STEP,
    CHUNK,
    GROUP,
    STEP,
    WINDOW,
    WINDOW_STEP,
    Ladder,
    Sizes,
    encode,
    encode_levels,
    save,
)
from .stream import choose_levels

__all__ = [
    "ANCHOR_STEP",
    "CHUNK",
    "GROUP",
    "HOW_TO_FIT",
    "LEVELS",
    "STEP",
    "WINDOW",
    "WINDOW_STEP",
    "Ladder",
    "LayerProfile",
    "LayerSteps",
    "Sizes",
    "choose_levels",
    "decode",
    "encode",
    "encode_levels",
    "fit_cachegen",
    "inspect",
    "load",
    "load_profile",
    "save",
    "save_profile",
]
