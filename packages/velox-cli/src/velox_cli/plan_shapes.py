"""The model shapes (mlx-lm configs, random weights) of ``velox plan`` and of the benchmarks,
which take them from here: ``benchmarks/e2e.py`` runs ``llama3-8b``, ``qwen2.5-7b`` and
``small``, ``benchmarks/capacity.py`` also ``llama3-70b`` and ``tiny``."""

from __future__ import annotations

from typing import Any

__all__ = ["SHAPES", "VOCAB", "WEIGHTS"]

_LLAMA3_ROPE = {
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
    "rope_type": "llama3",
}
_LLAMA3_8B = {
    "model_type": "llama",
    "hidden_size": 4096,
    "num_hidden_layers": 32,
    "intermediate_size": 14336,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "vocab_size": 128256,
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "max_position_embeddings": 131072,
    "rope_scaling": _LLAMA3_ROPE,
    "tie_word_embeddings": False,
}
SHAPES: dict[str, dict[str, Any]] = {
    "llama3-8b": _LLAMA3_8B,
    "qwen2.5-7b": {
        "model_type": "qwen2",
        "hidden_size": 3584,
        "num_hidden_layers": 28,
        "intermediate_size": 18944,
        "num_attention_heads": 28,
        "num_key_value_heads": 4,
        "vocab_size": 152064,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "max_position_embeddings": 131072,
        "tie_word_embeddings": False,
    },
    "llama3-70b": {  # capacity.py's: the 8B's config but for these
        **_LLAMA3_8B,
        "hidden_size": 8192,
        "num_hidden_layers": 80,
        "intermediate_size": 28672,
        "num_attention_heads": 64,
    },
    "small": {  # e2e.py's CPU shape: 8 KV heads of 64 channels
        "model_type": "llama",
        "hidden_size": 512,
        "num_hidden_layers": 4,
        "intermediate_size": 1024,
        "num_attention_heads": 8,
        "num_key_value_heads": 8,
        "head_dim": 64,
        "vocab_size": 2048,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "max_position_embeddings": 131072,
        "tie_word_embeddings": True,
    },
    "tiny": {  # capacity.py --tiny's: sixteen layers of one 128-wide KV head
        "model_type": "llama",
        "hidden_size": 32,
        "num_hidden_layers": 16,
        "intermediate_size": 64,
        "num_attention_heads": 1,
        "num_key_value_heads": 1,
        "head_dim": 128,
        "vocab_size": 512,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "max_position_embeddings": 131072,
        "tie_word_embeddings": True,
    },
}
# a shape's weights: mlx-lm's nn.quantize at these bits, group 64 (None: unquantized, in dtype)
WEIGHTS = {"4bit": 4, "8bit": 8, "bf16": None, "fp32": None}
VOCAB = 512  # the measurement model's vocabulary (its prompts' ids and a text's bytes fit)
