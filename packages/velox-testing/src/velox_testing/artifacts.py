"""Test aids of the methods that fit a per-model artifact (:mod:`velox_core.artifacts`): an
artifact fitted on the conformance model, an artifact search path that holds nothing else,
the refusals of a missing or foreign artifact, the search by the model's fingerprint, the
check that a saved cache outlives its artifact and the method's ``show`` command. Each takes
the method's own fit, save and cache as arguments: a method's tests need no other method
package."""

from __future__ import annotations

import shutil
from collections.abc import Callable
from functools import cache
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
import pytest

from .kv import kv_data
from .models import conformance_model

__all__ = [
    "assert_artifact_refusals",
    "assert_found_by_fingerprint",
    "fitted_artifact",
    "isolated_artifacts",
    "loaded_without_artifact",
    "shown_artifact",
]


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


def assert_artifact_refusals(
    monkeypatch: Any,
    folder: Path,
    missing: type[Exception],
    spec: str,
    fitted: Any,
    standalone: Any,
    noun: str,
) -> None:
    """The refusals of a method whose caches read a fitted artifact, with artifacts looked up
    in ``folder`` only (:func:`isolated_artifacts`): ``make_cache`` of
    :func:`conformance_model` and ``spec`` (``"<method>..."``; no artifact fitted for the
    model in reach) raises ``missing``, naming the method's fit command; ``fitted`` (a cache
    that names the conformance model's artifact) is refused for a model of another depth;
    ``standalone`` (a cache that names no artifact, used without a model) refuses 400 tokens
    with ``no <noun>``."""
    from velox_core import make_cache

    isolated_artifacts(monkeypatch, folder)
    method = spec.split(":")[0]
    with pytest.raises(missing, match=f"python -m velox_{method} fit --model PATH"):
        make_cache(conformance_model(), spec)
    with pytest.raises(ValueError, match="another model"):
        make_cache(conformance_model(num_hidden_layers=3), fitted)
    k, v = kv_data(t=400)
    with pytest.raises(ValueError, match=f"no {noun}"):
        standalone.update_and_fetch(k, v)


def assert_found_by_fingerprint(
    monkeypatch: Any,
    folder: Path,
    template: Any,
    artifact: str | Path,
    sides: tuple[str, ...] = ("key", "value"),
) -> list:
    """With artifacts looked up in ``folder`` only (:func:`isolated_artifacts`), a copy there
    of ``artifact`` (fitted for :func:`conformance_model`) is found by the model's
    fingerprint: in every layer of ``make_cache(conformance_model(), template)``
    (``template``, a spec or a cache, names no artifact), the first tier's codec of each of
    ``sides`` reads that copy with its own layer. Returns the caches."""
    from velox_core import make_cache

    isolated_artifacts(monkeypatch, folder)
    path = Path(shutil.copy(artifact, Path(folder) / "found.safetensors"))
    caches = make_cache(conformance_model(), template)
    for i, layer_cache in enumerate(caches):
        for side in sides:
            codec = getattr(layer_cache.tiers[0], f"{side}_codec")
            assert (codec._path, codec.layer) == (str(path), i), (i, side)
    return caches


def shown_artifact(main: Callable[[list[str]], int], artifact: str, capsys: Any) -> str:
    """What a method's ``show`` command (``main``, its ``python -m velox_<method>``) prints for
    ``artifact``, which it shows with exit code 0; a path beside it that holds no file exits
    with 2."""
    assert main(["show", artifact]) == 0
    out = capsys.readouterr().out
    assert main(["show", str(Path(artifact).with_suffix(".none"))]) == 2
    return out


def loaded_without_artifact(
    model: Any, make: Callable[..., Any], artifact: str | Path, folder: Path
) -> tuple:
    """Caches of ``make(artifact=path)`` (a cache class, or a ``functools.partial`` of one
    with its settings; ``path``, a copy of ``artifact`` in ``folder``) made by ``make_cache``
    on ``model``, prefilled with 200 random tokens and saved to ``folder``; then the copy is
    removed and the saved caches are loaded. Asserts that both give the next token the same
    logits (``atol`` 1e-3): a saved cache carries what it read from its artifact.

    Returns:
        ``(caches, loaded)``.
    """
    from velox_core import load_cache, make_cache, routed, save_cache

    artifact = shutil.copy(artifact, Path(folder) / "a.safetensors")
    caches = make_cache(model, make(artifact=str(artifact)))
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
