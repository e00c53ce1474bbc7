"""velox-vlm: velox's compressed KV caches for mlx-vlm's vision-language models.

``make_cache(model, spec)`` gives an mlx-vlm model's language model velox caches (Gemma 3's
sliding-window layers keep mlx-vlm's own); ``generate`` / ``stream_generate`` run mlx-vlm's
generate with them, multi-turn reuse (``prompt_cache_state``) included; ``install`` puts them
into mlx-vlm's own generate path. mlx-vlm is imported only when a function needs it.
"""

from .generate import (
    COMPANIONS,
    REFUSED,
    check_options,
    generate,
    install,
    make_cache,
    stream_generate,
    uninstall,
)
from .host import host

__all__ = [
    "COMPANIONS",
    "REFUSED",
    "check_options",
    "generate",
    "host",
    "install",
    "make_cache",
    "stream_generate",
    "uninstall",
]
