"""The checks ``velox serve`` makes of a request before it reaches mlx-lm's generation thread
(:mod:`velox_cli.serve`): fields mlx-lm reads without checking them, and a model other than
the served one."""

from __future__ import annotations

import math

__all__: list[str] = []


_FINITE_FIELDS = (  # the sampling numbers mlx-lm checks by type and range, not for NaN/inf
    "temperature",
    "top_p",
    "min_p",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
    "xtc_probability",
    "xtc_threshold",
)


def _vocab_size(handler) -> int | None:
    """Rows of the served model's output (token ids a request may name), where known."""
    model = getattr(handler.response_generator.model_provider, "model", None)
    n = getattr(getattr(model, "args", None), "vocab_size", None)
    return n if isinstance(n, int) and n > 0 else None


def _served_name(provider) -> str | None:
    """The served model as the command line named it (``--model``'s value), None without
    one."""
    path = provider.cli_args.model
    if path is None:
        return None
    given = [k for k, v in provider._model_map.items() if v == path and k != "default_model"]
    return given[0] if given else path


def _request_error(handler, request, stop_words) -> tuple[int, str] | None:
    """``(status, why)`` for a request that cannot be served, found before it reaches the
    generation thread (where mlx-lm lets a wrong type stop the thread, a token id past the
    vocabulary crash the process in MLX, and a request naming another model unload the
    served one to load it), or None."""
    provider = handler.response_generator.model_provider
    if provider.cli_args.model is not None:
        for field, name, known in (
            ("model", handler.requested_model, provider._model_map),
            ("draft_model", handler.requested_draft_model, provider._draft_model_map),
        ):
            if name not in known:
                return 404, (
                    f"{field} {name!r} is not served here: leave {field} out, or name the "
                    "served model as GET /v1/models lists it"
                )
    why = _field_error(handler, request, stop_words)
    return None if why is None else (400, why)


def _field_error(handler, request, stop_words) -> str | None:
    if request.request_type == "text":
        if not isinstance(request.prompt, str) or not request.prompt:
            return "prompt must be a non-empty string"
    elif not isinstance(request.messages, list) or not request.messages:
        return "messages must be a non-empty list"
    elif not all(isinstance(m, dict) and isinstance(m.get("role"), str) for m in request.messages):
        return "messages must be objects with a role (a string) and a content"
    if not isinstance(stop_words, list) or not all(isinstance(w, str) for w in stop_words):
        return "stop must be a string or a list of strings"
    for name in _FINITE_FIELDS:
        v = getattr(handler, name, None)
        if isinstance(v, float) and not math.isfinite(v):
            return f"{name} must be a finite number, got {v}"
    bias = getattr(handler, "logit_bias", None) or {}
    vocab = _vocab_size(handler) or 2**31
    for token, value in bias.items():
        if not 0 <= token < vocab:
            return f"logit_bias names token {token}, outside the vocabulary [0, {vocab})"
        if not math.isfinite(value):
            return f"logit_bias of token {token} must be a finite number, got {value}"
    return None
