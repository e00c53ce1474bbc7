"""Calibration tokens of a fit, and the model run on them (:mod:`velox_core.artifacts` builds
on these: a fit's calibration, its provenance and its file).

The names are public through :mod:`velox_core.artifacts`, which lists them.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten

from .cache.velox import VeloxCache
from .mlx_lm import make_cache
from .validation import check_int


def token_stream(tokenizer: Any, docs: list[str], special_tokens: bool = False) -> np.ndarray:
    """Documents tokenized and joined, each followed by the EOS token (where the tokenizer
    has one): calibration and evaluation text. ``special_tokens=False`` encodes without the
    tokenizer's own special tokens (a BOS), as the corpus was tokenized for training.

    Shapes: returns int32 ``(N,)``.
    """
    eos = getattr(tokenizer, "eos_token_id", None)
    out: list[int] = []
    kwargs = {} if special_tokens else {"add_special_tokens": False}
    for d in docs:
        out.extend(tokenizer.encode(d, **kwargs))
        if eos is not None:
            out.append(int(eos))
    return np.asarray(out, dtype=np.int32)


def calibration_ids(
    tokenizer_or_token_ids: Any,
    text: str | list[str] | None = None,
    who: str = "fit",
    max_tokens: int | None = None,
) -> tuple[np.ndarray, str]:
    """The calibration token ids of a fit, and how they were given (kept in the artifact).

    ``tokenizer_or_token_ids`` is the model's tokenizer, with ``text`` a str or a list of
    documents (each encoded and followed by the EOS token), or the token ids themselves (a
    non-empty array or list of ints, no ``text``). ``max_tokens`` keeps the first ones
    (None: all); ``who`` names the fit in errors.

    Returns:
        ``(ids, how)``: int64 ``(N,)`` and ``"<n> text(s) tokenized by the model"`` or
        ``"token ids"``.
    """
    source = tokenizer_or_token_ids
    if hasattr(source, "encode") and not isinstance(source, (str, bytes)):
        docs = [text] if isinstance(text, str) else list(text or [])
        if not docs or not all(isinstance(t, str) for t in docs):
            raise TypeError(f"{who}: with a tokenizer, pass text= (a str or a list of str)")
        out = token_stream(source, docs, special_tokens=True).astype(np.int64)
        how = f"{len(docs)} text(s) tokenized by the model"
    else:
        if text is not None:
            raise TypeError(f"{who}: text= is only for a tokenizer; token ids were given")
        arr = np.asarray(source)
        if (
            isinstance(source, (str, bytes))
            or arr.size == 0
            or not np.issubdtype(arr.dtype, np.integer)
        ):
            raise TypeError(f"{who}: pass a tokenizer (and text=) or a non-empty array of ids")
        out, how = arr.reshape(-1).astype(np.int64), "token ids"
    if max_tokens is not None:
        out = out[: check_int("max_tokens", max_tokens, minimum=1)]
    return out, how


def prefilled(
    model: Any, ids: np.ndarray, seq_len: int, chunk: int
) -> Iterator[tuple[mx.array, list[tuple[int, Any]]]]:
    """Run ``model`` on the calibration tokens ``ids`` cut into sequences of ``seq_len``
    tokens, each from position 0 in fresh :class:`~velox_core.VeloxCache` caches, prefilled
    ``chunk`` tokens at a time (bounds the attention memory).

    Yields:
        per sequence, ``(tokens, caches)``: int ``(1, T)`` and ``(layer, cache)`` of every
        layer with a velox cache, holding the sequence's keys and values.
    """
    for s in range(0, ids.size, seq_len):
        seq = mx.array(ids[s : s + seq_len])[None]
        caches = make_cache(model, lambda i: VeloxCache())
        for c in range(0, seq.shape[1], chunk):
            model(seq[:, c : c + chunk], cache=caches)
        yield seq, [(i, c) for i, c in enumerate(caches) if isinstance(c, VeloxCache)]


def model_dtype(model: Any) -> str:
    """The dtype of the model's first parameter, as a fit records it (``""``: none)."""
    params = tree_flatten(model.parameters())
    return str(params[0][1].dtype) if params else ""
