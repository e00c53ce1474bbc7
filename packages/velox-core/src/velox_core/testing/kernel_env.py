"""Kernel settings for a test, through the environment the configuration is read from."""

from __future__ import annotations

from typing import Any

from ..kernels import config

__all__ = ["kernel_env"]


def kernel_env(monkeypatch: Any, name: str, value: str | None) -> config.KernelConfig:
    """Set ``name`` (a ``VELOX_*`` kernel setting, :data:`velox_core.kernels.config.ENVIRONMENT`)
    to ``value`` (None: unset it) and put the configuration the environment now gives in force;
    both are restored after the test by ``monkeypatch``. Raises what
    :meth:`~velox_core.kernels.config.KernelConfig.from_environ` raises for a bad value."""
    if name not in {n for n, _ in config.ENVIRONMENT.values()}:
        raise ValueError(f"kernel_env: {name} is not a kernel setting")
    if value is None:
        monkeypatch.delenv(name, raising=False)
    else:
        monkeypatch.setenv(name, value)
    cfg = config.KernelConfig.from_environ()
    monkeypatch.setattr(config, "_CURRENT", [cfg])
    return cfg
