"""Argument checks that fail early with a message naming the parameter and what is allowed."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import mlx.core as mx

__all__ = [
    "FLOAT_DTYPES",
    "check_array",
    "check_bits",
    "check_choice",
    "check_divides",
    "check_float",
    "check_int",
    "check_kv",
    "check_widths",
]

FLOAT_DTYPES = (mx.float16, mx.bfloat16, mx.float32)


def check_int(
    name: str, value: Any, *, minimum: int | None = None, maximum: int | None = None
) -> int:
    """Return ``value`` if it is an int within ``[minimum, maximum]``, else raise."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    if minimum is not None and value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    if maximum is not None and value > maximum:
        raise ValueError(f"{name} must be <= {maximum}, got {value}")
    return value


def check_divides(method: str, name: str, group: int, dim: int, what: str, why: str) -> None:
    """Raise ``ValueError`` unless ``group`` divides ``dim``, naming the method, the parameter,
    the head dim (``what``: "key head dim", "value head dim"), why it must and divisors to use.
    """
    if dim % group:
        fits = [d for d in (8, 16, 32, 64, 128) if dim % d == 0] or [1]
        raise ValueError(
            f"{method}: {name}={group} must divide the {what} {dim} ({why}); choose a "
            f"divisor of {dim}, e.g. {', '.join(map(str, fits))}"
        )


def check_float(
    name: str,
    value: Any,
    *,
    minimum: float | None = None,
    maximum: float | None = None,
    open_min: bool = False,
) -> float:
    """Return ``float(value)`` if it is a real number within the bounds, else raise."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number, got {type(value).__name__} {value!r}")
    value = float(value)
    if minimum is not None and (value < minimum or (open_min and value == minimum)):
        op = ">" if open_min else ">="
        raise ValueError(f"{name} must be {op} {minimum}, got {value}")
    if maximum is not None and value > maximum:
        raise ValueError(f"{name} must be <= {maximum}, got {value}")
    return value


def check_choice(name: str, value: Any, choices: Iterable[Any]) -> Any:
    choices = tuple(choices)
    if value not in choices:
        allowed = ", ".join(repr(c) for c in choices)
        raise ValueError(f"{name} must be one of {allowed}; got {value!r}")
    return value


def check_bits(name: str, value: Any, minimum: int = 1, maximum: int = 8) -> int:
    """Bit widths are ints in ``[minimum, maximum]``."""
    return check_int(name, value, minimum=minimum, maximum=maximum)


def check_widths(cfg: Any, minimum: int = 2, maximum: int = 8) -> None:
    """Check a config's shared width names: ``bits``, and ``key_bits``/``value_bits`` when set
    (ints in ``[minimum, maximum]``; ``bits=None`` is left to the caller)."""
    for name in ("bits", "key_bits", "value_bits"):
        if getattr(cfg, name, None) is not None:
            check_bits(name, getattr(cfg, name), minimum, maximum)


def check_array(
    name: str,
    x: Any,
    *,
    ndim: int | None = None,
    min_ndim: int | None = None,
    dtypes: tuple | None = None,
) -> mx.array:
    if not isinstance(x, mx.array):
        raise TypeError(f"{name} must be an mlx.core.array, got {type(x).__name__}")
    if ndim is not None and x.ndim != ndim:
        raise ValueError(f"{name} must have {ndim} dimensions, got shape {tuple(x.shape)}")
    if min_ndim is not None and x.ndim < min_ndim:
        raise ValueError(f"{name} must have at least {min_ndim} dimensions, got {tuple(x.shape)}")
    if dtypes is not None and x.dtype not in dtypes:
        allowed = ", ".join(str(d) for d in dtypes)
        raise TypeError(f"{name} must have dtype in ({allowed}), got {x.dtype}")
    return x


def check_kv(keys: Any, values: Any) -> None:
    """Keys and values as mlx-lm passes them: ``(B, H, T, D)`` float arrays that agree."""
    check_array("keys", keys, ndim=4, dtypes=FLOAT_DTYPES)
    check_array("values", values, ndim=4, dtypes=FLOAT_DTYPES)
    if keys.shape[:3] != values.shape[:3]:
        raise ValueError(
            "keys and values must agree on (batch, kv_heads, tokens): "
            f"got keys {tuple(keys.shape)} and values {tuple(values.shape)}"
        )
    if keys.shape[2] == 0:
        raise ValueError("keys and values must hold at least one token")
