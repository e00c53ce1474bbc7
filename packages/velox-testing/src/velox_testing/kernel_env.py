"""Kernel settings for a test, through the environment the configuration is read from."""

from __future__ import annotations

from typing import Any

from velox_core.kernels import config

__all__ = ["kernel_env"]


def kernel_env(monkeypatch: Any, name: str, value: str | None) -> Any:
    """Set ``name`` (a ``VELOX_*`` kernel setting: velox-core's,
    :data:`velox_core.kernels.config.ENVIRONMENT`, or one a method package registered,
    :func:`velox_core.kernels.config.register_settings`) to ``value`` (None: unset it) and put
    the record the environment now gives in force; both are restored after the test by
    ``monkeypatch``. Returns that record. Raises what its ``from_environ`` raises for a bad
    value."""
    package = config.settings_of(name)
    if package is None and name not in {n for n, _ in config.ENVIRONMENT.values()}:
        raise ValueError(f"kernel_env: {name} is not a kernel setting")
    if value is None:
        monkeypatch.delenv(name, raising=False)
    else:
        monkeypatch.setenv(name, value)
    if package is not None:
        record = package.from_environ()
        monkeypatch.setitem(config._PACKAGE, package, record)
        return record
    cfg = config.KernelConfig.from_environ()
    monkeypatch.setattr(config, "_CURRENT", [cfg])
    return cfg
