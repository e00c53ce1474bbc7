"""Test aids of the methods that fit a per-model artifact (:mod:`velox_core.artifacts`): an
artifact fitted on the conformance model, an artifact search path that holds nothing else,
and the check that a saved cache outlives its artifact. Each takes the method's own fit,
save and cache as arguments: a method's tests need no other method package."""

from __future__ import annotations

from collections.abc import Callable
from functools import cache
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np

from .models import conformance_model

__all__ = ["fitted_artifact", "isolated_artifacts", "loaded_without_artifact"]


def fitted_artifact(
    fit: Callable[..., Any],
    save: Callable[[Any, Path], Path],
    folder: Path,
    name: str = "model",
    tokens: int = 1024,
    **options: Any,
) -> str:
    """The path of an artifact that ``fit`` fits on :func:`conformance_model` (``tokens``
    random token ids below 512, seed 0; ``options`` are the fit's keyword arguments, such as
    ``seq_len=512``) and ``save`` writes to ``folder/<name>.safetensors``: fitted once per
    process for the same arguments."""
    return _fitted(fit, save, folder, name, tokens, tuple(sorted(options.items())))


@cache
def _fitted(fit, save, folder: Path, name: str, tokens: int, options: tuple) -> str:
    ids = np.random.default_rng(0).integers(0, 512, tokens)
    art = fit(conformance_model(), ids, **dict(options))
    return str(save(art, Path(folder) / f"{name}.safetensors"))


def isolated_artifacts(monkeypatch: Any, folder: Path) -> None:
    """Artifacts are looked up in ``folder`` only: ``$VELOX_ARTIFACTS``, ``$HOME`` (so
    ``~/.cache/velox``), ``$VELOX_SHARED`` and the working directory (whose ``shared/`` the
    shipped artifacts are found in) all point there."""
    monkeypatch.setenv("VELOX_ARTIFACTS", str(folder))
    monkeypatch.setenv("HOME", str(folder))
    monkeypatch.chdir(folder)
    monkeypatch.setenv("VELOX_SHARED", str(folder))


def loaded_without_artifact(model: Any, template: Any, artifact: Path, folder: Path) -> tuple:
    """Caches of ``template`` (made by ``make_cache`` on ``model``; it names ``artifact``),
    prefilled with 200 random tokens and saved to ``folder``; then ``artifact`` is removed and
    the saved caches are loaded. Asserts that both give the next token the same logits
    (``atol`` 1e-3): a saved cache carries what it read from its artifact.

    Returns:
        ``(caches, loaded)``.
    """
    from velox_core import load_cache, make_cache, routed, save_cache

    caches = make_cache(model, template)
    prompt = mx.random.randint(0, 512, (1, 200), key=mx.random.key(4))
    with routed(model):
        model(prompt, cache=caches)
        save_cache(Path(folder) / "c.safetensors", caches)
        Path(artifact).unlink()
        loaded = load_cache(Path(folder) / "c.safetensors")
        a = model(mx.array([[5]]), cache=caches)
        b = model(mx.array([[5]]), cache=loaded)
    assert mx.allclose(a, b, atol=1e-3).item()
    return caches, loaded
