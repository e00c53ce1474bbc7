"""Test aids: tiny random-weight mlx-vlm models built from config dicts (no download), a
processor for mlx-vlm's generate, and image prompts for them.

Two families of mlx-vlm 0.7's own model code: ``"qwen2_vl"`` (Qwen2-VL: multimodal RoPE, a
ViT with 2x2 patch merging, full attention in every layer) and ``"gemma3"`` (Gemma 3: a SigLIP
tower pooled to ``mm_tokens_per_image`` tokens, sliding-window layers every other layer with
mlx-vlm's ``RotatingKVCache``).
"""

from __future__ import annotations

import copy
from typing import Any

import mlx.core as mx
from mlx.utils import tree_map

__all__ = ["FAMILIES", "IMAGE_TOKEN", "image_prompt", "tiny_config", "tiny_processor", "tiny_vlm"]

IMAGE_TOKEN = 500  # the image placeholder id of both tiny configs (vocabulary of 512)
_VISION_START, _VISION_END = 502, 503  # Qwen2-VL's markers around an image's tokens

_QWEN_TEXT = {
    "model_type": "qwen2_vl",
    "hidden_size": 256,
    "num_hidden_layers": 2,
    "intermediate_size": 256,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "rms_norm_eps": 1e-6,
    "vocab_size": 512,
    "rope_theta": 10000.0,
    "rope_scaling": {"type": "mrope", "mrope_section": [8, 12, 12]},
    "max_position_embeddings": 32768,
}
_GEMMA_TEXT = {
    "model_type": "gemma3_text",
    "hidden_size": 128,
    "num_hidden_layers": 4,
    "intermediate_size": 256,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "vocab_size": 512,
    "query_pre_attn_scalar": 64,
    "sliding_window": 16,
    "sliding_window_pattern": 2,
    "mm_tokens_per_image": 4,
    "max_position_embeddings": 32768,
}
FAMILIES: dict[str, dict[str, Any]] = {
    "qwen2_vl": {
        "model_type": "qwen2_vl",
        **{k: v for k, v in _QWEN_TEXT.items() if k != "model_type"},
        "image_token_id": IMAGE_TOKEN,
        "video_token_id": 501,
        "vision_start_token_id": _VISION_START,
        "text_config": _QWEN_TEXT,
        "vision_config": {
            "model_type": "qwen2_vl",
            "depth": 1,
            "embed_dim": 32,
            "hidden_size": 256,
            "num_heads": 2,
            "patch_size": 14,
            "spatial_patch_size": 14,
            "spatial_merge_size": 2,
            "temporal_patch_size": 2,
            "in_channels": 3,
            "mlp_ratio": 2.0,
        },
    },
    "gemma3": {
        "model_type": "gemma3",
        "hidden_size": 128,
        "vocab_size": 512,
        "image_token_index": IMAGE_TOKEN,
        "pad_token_id": 0,
        "text_config": _GEMMA_TEXT,
        "vision_config": {
            "model_type": "siglip_vision_model",
            "num_hidden_layers": 1,
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_attention_heads": 2,
            "patch_size": 14,
            "image_size": 56,
        },
    },
}


def tiny_config(family: str = "qwen2_vl", **text: Any) -> dict[str, Any]:
    """The config dict (``config.json`` contents) of :func:`tiny_vlm`'s ``family``; ``text``
    overrides language-model fields (``num_hidden_layers=4``, say)."""
    if family not in FAMILIES:
        raise ValueError(f"unknown family {family!r}; choose from {', '.join(FAMILIES)}")
    cfg = copy.deepcopy(FAMILIES[family])
    cfg["text_config"].update(text)
    if family == "qwen2_vl":  # Qwen2-VL reads its text fields from the top level too
        cfg.update({k: v for k, v in text.items() if k != "model_type"})
    return cfg


def tiny_vlm(
    family: str = "qwen2_vl",
    seed: int = 0,
    dtype: mx.Dtype = mx.float16,
    weight_scale: float = 2.0,
    **text: Any,
):
    """A small randomly initialized mlx-vlm model of ``family`` (built as ``mlx_vlm.load``
    builds one from its config, without weights). Matrices are multiplied by
    ``weight_scale``: at the default initialization a random model's greedy output collapses
    to one repeated token, which would make token comparisons between caches vacuous."""
    from mlx_vlm.utils import get_model_and_args, update_module_configs

    cfg = tiny_config(family, **text)
    arch, _ = get_model_and_args(cfg)
    config = update_module_configs(
        arch.ModelConfig.from_dict(copy.deepcopy(cfg)), arch, cfg, ["text", "vision"]
    )
    mx.random.seed(seed)
    model = arch.Model(config)
    if weight_scale != 1.0:
        model.update(tree_map(lambda p: p * weight_scale if p.ndim == 2 else p, model.parameters()))
    model.set_dtype(dtype)
    mx.eval(model.parameters())
    return model


def tiny_processor(eos_token_id: int = -1):
    """A processor for mlx-vlm's ``generate``: a byte-level BPE tokenizer trained here on a
    few lines (vocabulary under 300) with mlx-vlm's streaming detokenizer and stopping
    criteria. ``eos_token_id`` is the only token that stops a generation (default -1: none
    does, so runs last ``max_tokens``)."""
    from mlx_vlm.tokenizer_utils import NaiveStreamingDetokenizer
    from mlx_vlm.utils import StoppingCriteria
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    bpe.train_from_iterator(["a picture of a cat on a mat", "what is in the image?"], trainer)
    tok = PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<|endoftext|>")
    tok.detokenizer = NaiveStreamingDetokenizer(tok)
    tok.stopping_criteria = StoppingCriteria([eos_token_id], tok)
    return tok


def image_prompt(
    model: Any, text_before: list[int], text_after: list[int], seed: int = 1
) -> dict[str, Any]:
    """The keyword arguments of ``stream_generate`` for a prompt with one random image between
    two runs of text tokens: ``input_ids`` (image placeholders included), ``pixel_values``,
    ``mask`` and the family's own fields (Qwen2-VL's ``image_grid_thw``)."""
    mx.random.seed(seed)
    family = model.config.model_type
    if family == "qwen2_vl":
        vc = model.config.vision_config
        grid = (1, 4, 4)  # frames, patch rows, patch columns
        patches = grid[0] * grid[1] * grid[2]
        dim = vc.in_channels * vc.temporal_patch_size * vc.patch_size**2
        tokens = patches // vc.spatial_merge_size**2
        ids = [*text_before, _VISION_START, *[IMAGE_TOKEN] * tokens, _VISION_END, *text_after]
        extra = {"image_grid_thw": mx.array([grid])}
        pixels = mx.random.normal((patches, dim))
    elif family == "gemma3":
        size = model.config.vision_config.image_size
        tokens = model.config.text_config.mm_tokens_per_image
        ids = [*text_before, *[IMAGE_TOKEN] * tokens, *text_after]
        extra = {}
        pixels = mx.random.normal((1, 3, size, size))
    else:
        raise ValueError(f"image_prompt: no image layout for model type {family!r}")
    input_ids = mx.array([ids], dtype=mx.int32)
    return {
        "input_ids": input_ids,
        "pixel_values": pixels,
        "mask": mx.ones_like(input_ids),
        **extra,
    }
