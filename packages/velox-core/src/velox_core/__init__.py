"""velox-core: the shared core of velox, KV-cache compression for MLX / mlx-lm.

Layers, bottom up: primitives (:mod:`velox_core.ops`), codecs (:mod:`velox_core.codec`),
retention policies (:mod:`velox_core.policy`) and caches (:mod:`velox_core.cache`), plus the
mlx-lm integration (:mod:`velox_core.mlx_lm`), saving and loading (:mod:`velox_core.io`) and
the method registry (:mod:`velox_core.registry`). Importing it has no side effects.
"""

from importlib.metadata import PackageNotFoundError, version

from .cache import PackedStore, Segment, Tier, VeloxBatch, VeloxCache, attend
from .cache.latent import LatentCache
from .cache.preset import (
    CodeWidths,
    PresetCache,
    check_kept_codes,
    config_fields,
    kept_codecs,
    resolve_bits,
)
from .cache.uniform import UniformCache, UniformConfig
from .codec import Codec, Identity, Packed, Uniform
from .distributed import recv_cache, send_cache
from .io import inspect_cache_file, load_cache, save_cache
from .mlx_lm import (
    disable,
    enable,
    generate,
    install,
    make_cache,
    routed,
    stream_generate,
    uninstall,
)
from .policy import RetentionPolicy
from .registry import Method, get_method, make, methods, parse_spec

try:
    __version__ = version("velox-core")
except PackageNotFoundError:  # running from a source tree
    __version__ = "0.0.0+source"

__all__ = [
    "CodeWidths",
    "Codec",
    "Identity",
    "LatentCache",
    "Method",
    "Packed",
    "PackedStore",
    "PresetCache",
    "RetentionPolicy",
    "Segment",
    "Tier",
    "Uniform",
    "UniformCache",
    "UniformConfig",
    "VeloxBatch",
    "VeloxCache",
    "__version__",
    "attend",
    "check_kept_codes",
    "config_fields",
    "disable",
    "enable",
    "generate",
    "get_method",
    "inspect_cache_file",
    "install",
    "kept_codecs",
    "load_cache",
    "make",
    "make_cache",
    "methods",
    "parse_spec",
    "recv_cache",
    "resolve_bits",
    "routed",
    "save_cache",
    "send_cache",
    "stream_generate",
    "uninstall",
]
