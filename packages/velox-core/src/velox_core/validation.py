"""Argument checks that fail early with a message naming the parameter and what is allowed."""

from __future__ import annotations

import math
import numbers
import os
from collections.abc import Callable, Iterable
from typing import Any

import mlx.core as mx

__all__ = [
    "check_array",
    "check_bits",
    "check_bool",
    "check_choice",
    "check_counts",
    "check_divides",
    "check_float",
    "check_int",
    "check_key_value_widths",
    "check_kv",
    "check_optional",
    "check_path",
    "check_token_groups",
    "check_widths",
]

FLOAT_DTYPES = (mx.float16, mx.bfloat16, mx.float32)


def is_str_map(value: Any) -> bool:
    """Whether ``value`` is a dict of str to str (a file's free metadata)."""
    return isinstance(value, dict) and all(
        isinstance(k, str) and isinstance(v, str) for k, v in value.items()
    )


def check_metadata(metadata: Any, who: str) -> None:
    """``TypeError`` naming ``who`` unless ``metadata`` is None or maps str to str (the free
    metadata a saved cache carries)."""
    if metadata is not None and not is_str_map(metadata):
        raise TypeError(f"{who}: metadata must map str to str")


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


def check_token_groups(
    method: str,
    group: int,
    key_dim: int,
    value_dim: int,
    key_axis: str | None = "token",
    value_axis: str | None = "token",
) -> None:
    """``group`` divides the head dim of each side coded in per-token groups (axis
    ``"token"``: a token's channels split into groups of ``group``); a side with per-channel
    groups (``"channel"``) or none (None) takes any head dim.

    Raises:
        ValueError: :func:`check_divides`'s, naming ``method``, the side and its head dim.
    """
    for side, axis, dim in (("key", key_axis, key_dim), ("value", value_axis, value_dim)):
        if axis == "token":
            why = f"{side}s are quantized per token in groups of `group` channels"
            check_divides(method, "group", group, dim, f"{side} head dim", why)


def check_float(
    name: str,
    value: Any,
    *,
    minimum: float | None = None,
    maximum: float | None = None,
    open_min: bool = False,
    finite: bool = True,
) -> float:
    """Return ``float(value)`` if it is a real number within the bounds, else raise.

    NaN and +-inf are refused (``ValueError``) unless ``finite=False``; a NaN passes every
    comparison with a bound, so without this it would slip through any range. A parameter
    that gives an infinity a meaning says so with ``finite=False`` (NaN is refused still)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number, got {type(value).__name__} {value!r}")
    value = float(value)
    if math.isnan(value) or (finite and math.isinf(value)):
        raise ValueError(f"{name} must be a finite number, got {value}")
    if minimum is not None and (value < minimum or (open_min and value == minimum)):
        op = ">" if open_min else ">="
        raise ValueError(f"{name} must be {op} {minimum}, got {value}")
    if maximum is not None and value > maximum:
        raise ValueError(f"{name} must be <= {maximum}, got {value}")
    return value


def check_finite_params(owner: str, params: dict[str, Any]) -> None:
    """Refuse (``ValueError`` naming ``owner`` and the parameter) every real, non-integer
    value among ``params`` that is NaN or +-inf, also inside tuples and lists
    (``prior[0]``). A method's float parameters pass here before its own checks, so one that
    has no range to check, or checks its range with comparisons a NaN passes, still refuses
    them; parameters of other types are left to those checks."""

    def walk(name: str, value: Any) -> None:
        if isinstance(value, (tuple, list)):
            for i, v in enumerate(value):
                walk(f"{name}[{i}]", v)
        elif (
            isinstance(value, numbers.Real)
            and not isinstance(value, numbers.Integral)
            and not math.isfinite(float(value))
        ):
            raise ValueError(f"{owner}: {name} must be a finite number, got {value}")

    for name, value in params.items():
        walk(name, value)


def check_bool(name: str, value: Any) -> bool:
    """Return ``value`` if it is ``True`` or ``False`` (not 0, 1 or a string), else raise."""
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be True or False, got {type(value).__name__} {value!r}")
    return value


def check_path(name: str, value: Any) -> str | None:
    """``value`` as a string path (``os.fspath``) if it is a ``str`` or ``os.PathLike``,
    ``None`` if it is ``None``, else raise ``TypeError``."""
    if value is None:
        return None
    if not isinstance(value, (str, os.PathLike)):
        raise TypeError(f"{name} must be a path or None, got {value!r}")
    return os.fspath(value)


def check_choice(name: str, value: Any, choices: Iterable[Any]) -> Any:
    choices = tuple(choices)
    if value not in choices:
        allowed = ", ".join(repr(c) for c in choices)
        raise ValueError(f"{name} must be one of {allowed}; got {value!r}")
    return value


def check_bits(name: str, value: Any, minimum: int = 1, maximum: int = 8) -> int:
    """Bit widths are ints in ``[minimum, maximum]``."""
    return check_int(name, value, minimum=minimum, maximum=maximum)


def check_widths(
    cfg: Any,
    minimum: int = 2,
    maximum: int = 8,
    *,
    check: Callable[[str, Any], Any] | None = None,
    bits_required: bool = False,
) -> None:
    """Check a config's shared width names, ``bits`` and ``key_bits``/``value_bits`` where set:
    ints in ``[minimum, maximum]``, or what ``check(name, value)`` accepts (a method's own rule,
    such as fractional widths), whose return value replaces the field. ``bits=None`` is left
    to the caller unless ``bits_required``."""
    for name in ("bits", "key_bits", "value_bits"):
        value = getattr(cfg, name, None)
        if value is None and not (bits_required and name == "bits"):
            continue
        ok = check_bits(name, value, minimum, maximum) if check is None else check(name, value)
        setattr(cfg, name, ok)


def check_key_value_widths(cfg: Any, key_minimum: int, low_bits: str) -> None:
    """Widths of a config whose keys take ``key_minimum`` to 8 bits and whose values are
    ``velox_core.Uniform`` codes (2 to 8): ``bits`` and ``key_bits`` in ``[key_minimum, 8]``,
    ``value_bits`` in ``[2, 8]``. A ``bits`` below 2 sets only the keys, so it needs
    ``value_bits``; ``low_bits`` says what such a ``bits`` gives the keys ("the key sketch")."""
    check_bits("bits", cfg.bits, key_minimum, 8)
    if cfg.key_bits is not None:
        check_bits("key_bits", cfg.key_bits, key_minimum, 8)
    if cfg.value_bits is not None:
        check_bits("value_bits", cfg.value_bits, 2, 8)
    elif cfg.bits < 2:
        raise ValueError(
            f"value_bits must be 2 to 8 (velox_core.Uniform); bits={cfg.bits} sets only "
            f"{low_bits}, so pass value_bits with it, e.g. key_bits={cfg.bits}, value_bits=4"
        )


def check_counts(cfg: Any, *names: str) -> None:
    """Each named field of ``cfg`` is an int >= 0 (``window``, ``sinks``, ``seed``...)."""
    for name in names:
        check_int(name, getattr(cfg, name), minimum=0)


def check_optional(cfg: Any, *names: str, minimum: int = 1) -> None:
    """Each named field of ``cfg`` is None (unset) or an int >= ``minimum`` (``layer``,
    ``rank``, ``key_group``...)."""
    for name in names:
        if getattr(cfg, name) is not None:
            check_int(name, getattr(cfg, name), minimum=minimum)


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
