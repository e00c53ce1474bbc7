"""velox caches on models split over processes: which methods can split, and why not.

**Sharded models.** ``model.shard(group)`` (mlx-lm's tensor parallelism: llama, qwen2 and
others) splits every attention layer by heads: each process stores only its share of the KV
heads, and :func:`~velox_core.make_cache` there builds caches of those heads. A method whose
caches treat each KV head on its own (quantizers, per-head eviction, ...) then holds on each
process exactly the heads' part of what it holds on one machine, and decodes the same tokens.
A method that mixes heads (a budget shared among a layer's heads, scores averaged over all
heads, channels permuted across heads, an SVD of all heads' channels) or needs an artifact
fitted on the whole model cannot be split so: :func:`split_refusal` names why, and
``make_cache`` raises with it. ``model.model.pipeline(group)`` (mlx-lm's pipeline stages)
keeps some layers per process; methods that link layers (a pyramid of budgets, cross-layer
merging) are refused there. A stage's last layer keeps mlx-lm's fp16 cache: mlx-lm ties its
send of the hidden state to that cache's ``keys``, which a velox cache does not have
(``make_cache`` keeps it, with its warning, where the layer's spec is the default; a velox
spec given for that layer in ``layers`` is refused).

Each method states its own answer: the ``split_refusal(config, by_heads, pipelined)``
classmethod of its cache class returns the reason ("" where it can be split), from the
class's ``mixes_heads`` and ``fitted_on_whole_model`` attributes (or its own override where
the answer depends on the settings), and this module adds what holds for every method (layers
linked across a pipeline's stages, a stage's last layer).
"""

from __future__ import annotations

from typing import Any

from .cache.velox import VeloxCache

__all__: list[str] = []

# why a pipeline stage's last layer keeps mlx-lm's cache
STAGE_LAST = (
    "mlx-lm ties its send of a pipeline stage's hidden state to the last layer's cache.keys, "
    "which a velox cache does not have"
)


def model_kv_heads(model: Any) -> int | None:
    """The model's KV heads per layer from its config (``num_key_value_heads``, else
    ``num_attention_heads``); None where the config has neither."""
    args = getattr(model, "args", None)
    for name in ("num_key_value_heads", "num_attention_heads"):
        v = args.get(name) if isinstance(args, dict) else getattr(args, name, None)
        if isinstance(v, int) and not isinstance(v, bool) and v > 0:
            return v
    return None


def pipeline_stage(model: Any) -> tuple[int, int] | None:
    """``(rank, stages)`` of a model split by mlx-lm's ``pipeline`` into more than one
    stage, else None."""
    inner = getattr(model, "model", None)
    size = getattr(inner, "pipeline_size", 1)
    if isinstance(size, int) and size > 1:
        return int(getattr(inner, "pipeline_rank", 0)), size
    return None


def stage_last_layer(model: Any, layer: int) -> bool:
    """Whether ``layer`` is the last layer of a pipeline stage of ``model``."""
    return pipeline_stage(model) is not None and layer == len(model.layers) - 1


def _links_layers(cache: VeloxCache) -> bool:
    own = getattr(type(cache).link_layers, "__func__", None)
    return own is not getattr(VeloxCache.link_layers, "__func__", None)


def split_refusal(
    model: Any, layer: int, route: Any, cache: VeloxCache, stage_last: bool = True
) -> str:
    """Why ``cache`` cannot serve ``layer`` of ``model`` where the model is split over
    processes ("" where it can, and on a model that is not split).

    ``route`` is the layer's :class:`~velox_core.router.Route`: a layer that stores fewer KV
    heads than the model's config has is split by heads (``model.shard``). With
    ``stage_last=False`` a pipeline stage's last layer is not refused for being the last
    (the caller keeps mlx-lm's cache there).
    """
    total = model_kv_heads(model)
    local = getattr(route, "kv_heads", None)
    by_heads = total is not None and local is not None and local < total
    stage = pipeline_stage(model)
    if not by_heads and stage is None:
        return ""
    where = []
    if by_heads:
        where.append(f"sharded by heads ({local} of the model's {total} KV heads here)")
    if stage is not None:
        where.append(f"split into pipeline stages (stage {stage[0]} of {stage[1]})")
    head = f"{cache.method} cannot run on a model {' and '.join(where)}: "
    # asked of the cache (a classmethod, unless a cache made of parts answers for them)
    own = cache.split_refusal(cache.config(), by_heads, stage is not None)
    if own:
        return head + own
    if stage is not None:
        if _links_layers(cache):
            return head + (
                "its caches are linked across the model's layers, and a stage holds only some "
                "of them"
            )
        if stage_last and stage_last_layer(model, layer):
            return head + (
                f"{STAGE_LAST}; leave that layer to the default spec (make_cache keeps it "
                "fp16) or give it None"
            )
    return ""
