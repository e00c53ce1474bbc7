"""Small random-weight mlx-lm models and a tiny tokenizer, for tests that need no download,
and the installed methods' recommended specs the tests run them with."""

from __future__ import annotations

import importlib
from functools import lru_cache
from typing import Any

import mlx.core as mx
from mlx.utils import tree_map

from velox_core import methods

__all__ = [
    "FAMILIES",
    "OTHER_FAMILIES",
    "recommended_specs",
    "spec_text",
    "tiny_config",
    "tiny_model",
    "tiny_tokenizer",
]

_BASE = {
    "hidden_size": 128,
    "num_hidden_layers": 2,
    "intermediate_size": 256,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "rms_norm_eps": 1e-5,
    "vocab_size": 512,
}
FAMILIES: dict[str, tuple[str, dict[str, Any]]] = {
    "llama": ("llama", {"head_dim": 64, "rope_theta": 10000.0}),
    "mistral": ("llama", {"head_dim": 64, "rope_theta": 1e6}),
    "qwen2": ("qwen2", {"hidden_size": 256}),
    "qwen3": (
        "qwen3",
        {
            "head_dim": 64,
            "max_position_embeddings": 32768,
            "tie_word_embeddings": True,
            "rope_theta": 1e6,
        },
    ),
    "gemma3": (
        "gemma3_text",
        {
            "head_dim": 64,
            "sliding_window": 16,
            "sliding_window_pattern": 2,
            "query_pre_attn_scalar": 64,
            "num_hidden_layers": 4,
        },
    ),
    "phi3": ("phi3", {"hidden_size": 256}),
}
# families whose attention does not take mlx-lm's shared attention path with the keys and
# values its cache returns: DeepSeek-V3's multi-head latent attention caches a latent
# (kv_lora_rank channels, one head) and a RoPE key (qk_rope_head_dim channels) and attends
# with projections of them (dense MLPs only: MLX's CPU gather matmul of the MoE layers takes
# float32 only); Gemma 2 has its own attention code (logit soft-capping)
OTHER_FAMILIES: dict[str, tuple[str, dict[str, Any]]] = {
    "deepseek_v3": (
        "deepseek_v3",
        {
            "num_key_value_heads": 4,
            "kv_lora_rank": 64,
            "q_lora_rank": None,
            "qk_rope_head_dim": 16,
            "qk_nope_head_dim": 32,
            "v_head_dim": 32,
            "n_routed_experts": None,
            "max_position_embeddings": 4096,
        },
    ),
    "gemma2": ("gemma2", {"head_dim": 64, "query_pre_attn_scalar": 64}),
}


def tiny_config(family: str = "llama", **overrides: Any) -> dict[str, Any]:
    """The mlx-lm config (``config.json`` contents) of :func:`tiny_model`'s ``family``."""
    known = {**FAMILIES, **OTHER_FAMILIES}
    if family not in known:
        raise ValueError(f"unknown family {family!r}; choose from {', '.join(known)}")
    module, extra = known[family]
    return {
        "model_type": "mistral" if family == "mistral" else module,
        **_BASE,
        **extra,
        **overrides,
    }


def tiny_model(
    family: str = "llama",
    seed: int = 0,
    dtype: mx.Dtype = mx.float16,
    weight_scale: float = 2.0,
    **overrides: Any,
):
    """A small randomly initialized mlx-lm model of ``family`` (see :data:`FAMILIES` and
    :data:`OTHER_FAMILIES`).

    Matrices are multiplied by ``weight_scale``: at mlx-lm's default initialization a random
    model's greedy output collapses to one repeated token, which would make token-level
    comparisons between caches vacuous.
    """
    cfg = tiny_config(family, **overrides)
    module = {**FAMILIES, **OTHER_FAMILIES}[family][0]
    arch = importlib.import_module(f"mlx_lm.models.{module}")
    mx.random.seed(seed)
    model = arch.Model(arch.ModelArgs.from_dict(cfg))
    if weight_scale != 1.0:
        model.update(tree_map(lambda p: p * weight_scale if p.ndim == 2 else p, model.parameters()))
    model.set_dtype(dtype)
    mx.eval(model.parameters())
    return model


def conformance_model(head_dim: int = 128, **overrides: Any):
    """The tiny llama of the conformance suite's model-level tests: ``head_dim`` channels per
    head and hidden size ``2 * head_dim`` (other :func:`tiny_model` settings as given)."""
    return tiny_model("llama", head_dim=head_dim, hidden_size=2 * head_dim, **overrides)


_CORPUS = (
    "def add(a, b):\n    return a + b\n\nclass Point:\n    def __init__(self, x, y):\n"
    "        self.x = x\n        self.y = y\n\nfor i in range(10):\n    print(i, add(i, 1))\n"
    "import os\nimport sys\nvalue = {'key': [1, 2, 3], 'name': \"velox\"}\n"
)


def bpe_tokenizer(texts: list[str], vocab_size: int):
    """A byte-level BPE tokenizer trained on ``texts`` with at most ``vocab_size`` tokens,
    ``<|endoftext|>`` its end-of-text token, as a transformers ``PreTrainedTokenizerFast``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    bpe.train_from_iterator(texts, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<|endoftext|>")


@lru_cache(maxsize=1)
def _tokenizer():
    return bpe_tokenizer([_CORPUS] * 4, 400)


def tiny_tokenizer():
    """A byte-level BPE tokenizer (vocab < 512) wrapped for ``mlx_lm.generate``."""
    from mlx_lm.tokenizer_utils import TokenizerWrapper

    return TokenizerWrapper(_tokenizer())


def spec_text(name: str, params: dict[str, Any]) -> str:
    """The spec string of ``name`` with ``params`` (``"name:key=value,..."``), the inverse of
    :func:`velox_core.parse_spec`."""
    return name if not params else name + ":" + ",".join(f"{k}={v}" for k, v in params.items())


def recommended_specs() -> list[str]:
    """Every installed method's recommended settings (``Method.recommended``) as spec strings."""
    return [spec_text(n, p) for n, m in methods().items() for p in m.recommended]
