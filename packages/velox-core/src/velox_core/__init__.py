"""velox-core: the shared core of velox, KV-cache compression for MLX / mlx-lm.

Layers, bottom up: primitives (:mod:`velox_core.ops`), codecs (:mod:`velox_core.codec`),
retention policies (:mod:`velox_core.policy`) and caches (:mod:`velox_core.cache`), plus the
mlx-lm integration (:mod:`velox_core.mlx_lm`, with the attention router
:mod:`velox_core.router`), saving and loading (:mod:`velox_core.io`) and
the method registry (:mod:`velox_core.registry`). Importing it has no side effects.

Each public name has one home, the module whose ``__all__`` lists it: this package for what
users and most method packages call, :mod:`velox_core.ops` and :mod:`velox_core.policy` for
the primitives and policy pieces, the defining module for the rest (``velox_core.validation``,
``velox_core.kernels.records``...). A module whose ``__all__`` is empty is velox-core's own:
its names may change without notice. ``python tools/public_names.py`` counts them.
"""

from importlib.metadata import PackageNotFoundError, version

from .cache.batch import VeloxBatch
from .cache.latent import LatentCache
from .cache.preset import CodeWidths, PresetCache, config_fields
from .cache.tiers import Tier
from .cache.uniform import UniformCache
from .cache.velox import VeloxCache
from .codec.base import Codec, Packed
from .codec.identity import Identity
from .codec.uniform import Uniform
from .distributed import recv_cache, send_cache
from .io import inspect_cache_file, load_cache, save_cache
from .mlx_lm import generate, install, make_cache, stream_generate, uninstall
from .policy.base import RetentionPolicy
from .registry import Method, get_method, make, methods, parse_spec
from .router import disable, enable, routed

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
    "PresetCache",
    "RetentionPolicy",
    "Tier",
    "Uniform",
    "UniformCache",
    "VeloxBatch",
    "VeloxCache",
    "__version__",
    "config_fields",
    "disable",
    "enable",
    "generate",
    "get_method",
    "inspect_cache_file",
    "install",
    "load_cache",
    "make",
    "make_cache",
    "methods",
    "parse_spec",
    "recv_cache",
    "routed",
    "save_cache",
    "send_cache",
    "stream_generate",
    "uninstall",
]
