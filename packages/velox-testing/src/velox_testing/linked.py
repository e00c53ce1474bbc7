"""Checks of caches whose layers share state (:mod:`velox_core.cache.linked`)."""

from __future__ import annotations

import copy

import mlx.core as mx
import pytest

from velox_core import load_cache, make_cache, routed, save_cache

from .kv import decode_logits, rel_error
from .models import tiny_tokenizer

__all__ = ["assert_batch_generate_refused", "assert_linked_copies"]


def assert_batch_generate_refused(model, make, match: str) -> None:
    """mlx-lm's ``batch_generate`` over separately made linked caches (``make_cache(model,
    make())`` per prompt, routed) is refused with a ``ValueError`` matching ``match``: it
    merges each layer's caches alone, which cannot keep a group's shared state."""
    from mlx_lm.generate import batch_generate

    prompts = [[5, 6, 7, 8], [9, 10, 11]]
    with routed(model), pytest.raises(ValueError, match=match):
        batch_generate(
            model,
            tiny_tokenizer(),
            prompts,
            max_tokens=2,
            prompt_caches=[make_cache(model, make()) for _ in prompts],
        )


def assert_linked_copies(model, caches: list, path, shared: str) -> tuple[list, list]:
    """A file and a deepcopy of a model's linked caches keep the groups.

    The caches (of ``model``, made by ``make_cache``) prefill 120 tokens and decode two; then
    the file at ``path`` records each group's shared stores (``shared``: their record name,
    ``"dir"``, ``"lat"``...) once, with the group's first layer, and the file loaded back and
    a ``copy.deepcopy`` link the same layers (in groups of their own, not the originals'),
    hold the same bytes and decode the next three tokens as the caches do (routed).

    Returns:
        ``(loaded, deep-copied)`` caches, for the method's own checks.
    """
    prompt = mx.random.randint(0, 512, (1, 120), key=mx.random.key(1))
    with routed(model):
        decode_logits(model, caches, [5, 9], prompt)
    save_cache(path, caches)
    recorded = {n.split(".")[0] for n in mx.load(str(path)) if f".store.{shared}." in n}
    owners = {f"layer{i}" for i, c in enumerate(caches) if c.group and c.group.owner is c}
    assert recorded == owners, (recorded, owners)
    copies = load_cache(path), copy.deepcopy(caches)
    for other in copies:
        for i, (c, o) in enumerate(zip(caches, other)):
            assert (o.group is None) == (c.group is None), i
            assert o.group is None or o.group is not c.group, i
            together = [j for j, x in enumerate(caches) if c.group and x.group is c.group]
            assert together == [j for j, x in enumerate(other) if o.group and x.group is o.group]
        assert sum(c.logical_nbytes for c in other) == sum(c.logical_nbytes for c in caches)
    with routed(model):
        ref = decode_logits(model, caches, [3, 7, 11])
        for other in copies:
            assert rel_error(decode_logits(model, other, [3, 7, 11]), ref) < 1e-3
    return copies
