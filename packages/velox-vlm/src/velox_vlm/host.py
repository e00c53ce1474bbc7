"""mlx-vlm as a velox-core host (:mod:`velox_core.hosts`), registered through the entry point
``velox.hosts``: velox-core's ``make_cache``, ``install``, routing and ``save_cache`` then
serve mlx-vlm models (their ``language_model``'s layers, mlx-vlm's own attention function and
cache classes). Importing this module does not import mlx-vlm.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any

from velox_core.hosts import Host

__all__ = ["host", "language_model"]


def _owns(model: Any) -> bool:
    return type(model).__module__.startswith("mlx_vlm.")


def language_model(model: Any) -> Any:
    """The module whose layers hold caches: ``model.language_model`` (a whole mlx-vlm model)
    or ``model`` itself (a language model passed alone)."""
    return getattr(model, "language_model", model)


def _plain() -> Any:
    from mlx_vlm.models.cache import KVCache

    return KVCache()


def _is_plain(cache: Any) -> bool:
    from mlx_vlm.models.cache import KVCache

    return type(cache) is KVCache


def _saved() -> dict[str, type]:
    from mlx_vlm.models.cache import KVCache, RotatingKVCache

    return {"KVCache": KVCache, "RotatingKVCache": RotatingKVCache}


def _probe(lm: Any, tokens: Any, caches: list) -> None:
    """Run ``lm`` once, then restore the state it keeps between calls: Qwen2-VL's language
    model remembers the positions and RoPE deltas of its last prompt (``_position_ids``,
    ``_rope_deltas``), which the probe's two tokens would otherwise leave for the next
    prompt to read."""
    attrs = {k: v for k, v in vars(lm).items() if _private(k)}
    items = {k: v for k, v in lm.items() if _private(k)}
    try:
        lm(tokens, cache=caches)
    finally:
        for k in [k for k in vars(lm) if _private(k) and k not in attrs]:
            delattr(lm, k)
        vars(lm).update(attrs)
        for k in [k for k in lm if _private(k) and k not in items]:
            del lm[k]
        for k, v in items.items():
            dict.__setitem__(lm, k, v)  # as stored (an mlx Module keeps arrays as its items)


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


@lru_cache(maxsize=1)
def host() -> Host:
    """mlx-vlm's :class:`~velox_core.hosts.Host`."""
    return Host(
        name="mlx_vlm",
        owns=_owns,
        attention=("mlx_vlm.models.base", "mlx_vlm.models."),
        plain_cache=_plain,
        is_plain=_is_plain,
        language_model=language_model,
        probe=_probe,
        saved_classes=_saved,
        generate="velox_vlm.generate",
    )
