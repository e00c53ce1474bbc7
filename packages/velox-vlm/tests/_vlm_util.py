"""Test helpers: the tiny mlx-vlm models (built once per session), run results, and a
conversation continued turn by turn in one cache."""

from __future__ import annotations

import mlx.core as mx
from mlx_vlm.generate import generate_step

import velox_core
from velox_vlm.testing import tiny_vlm

# (family, seed, weight_scale) of models whose fp16 greedy run of PROMPT has no near-tie in its
# first 32 steps (the smallest top-2 log-probability gap is asserted where it matters)
TOKEN_MODELS = {"qwen2_vl": ("qwen2_vl", 1, 4.0), "gemma3": ("gemma3", 0, 4.0)}
PROMPT = [(7 * i + 3) % 400 + 1 for i in range(300)]  # 300 text tokens (ids 1..400)

_models: dict = {}


def model_of(family: str, seed: int = 0, weight_scale: float = 2.0):
    key = (family, seed, weight_scale)
    if key not in _models:
        _models[key] = tiny_vlm(family, seed=seed, weight_scale=weight_scale)
    return _models[key]


def tokens(results) -> tuple[list[int], list[mx.array]]:
    """Tokens and log-probabilities of a ``stream_generate`` run (its closing result repeats
    the last token and is dropped)."""
    rs = list(results)[:-1]
    return [r.token for r in rs], [r.logprobs for r in rs]


def continue_with(model, caches, suffix, full_kw, max_tokens):
    """``generate_step`` on ``suffix`` with ``caches`` holding the tokens before it: the
    continuation of a conversation fed turn by turn into one cache (Qwen2-VL's positions
    come from the whole prompt, as mlx-vlm's multi-turn reuse primes them)."""
    lm = model.language_model
    kw = {}
    full, mask = full_kw["input_ids"], full_kw.get("mask")
    if hasattr(lm, "get_rope_index"):
        pos, deltas = lm.get_rope_index(full, full_kw.get("image_grid_thw"), None, mask)
        kw = {"position_ids": pos, "rope_deltas": deltas}
    with velox_core.routed(model):
        out = list(
            zip(
                generate_step(
                    mx.array([suffix], dtype=mx.int32),
                    model,
                    None,
                    mask,
                    prompt_cache=caches,
                    max_tokens=max_tokens,
                    temperature=0.0,
                    **kw,
                ),
                range(max_tokens),
            )
        )
    return [int(t) for (t, _), _ in out], [lp for (_, lp), _ in out]
