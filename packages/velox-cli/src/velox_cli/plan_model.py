"""``velox plan``'s models: a named shape or a model on disk, its weights' bytes, its layer kinds,
and the small model its cache bytes are measured on.

A shape (:data:`~velox_cli.plan_shapes.SHAPES`) has its weights counted as the ``nbytes`` of
mlx-lm's own model at that config, built lazily and quantized as ``--weights`` says (nothing is
evaluated). A model on disk is read through its ``config.json``; its weights are the
``*.safetensors`` files' sizes, never loaded.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .plan_shapes import SHAPES, VOCAB, WEIGHTS

__all__ = ["SHAPES", "WEIGHTS", "ModelInfo", "model_info", "small_model"]


@dataclass
class ModelInfo:
    """What the plan needs of a model: its config, its weights' bytes and where they come from,
    the name its measured data is found by, and each layer's native cache kind."""

    name: str
    config: dict[str, Any]
    weights_bytes: int
    weights_from: str
    kinds: list[str] = field(default_factory=list)

    @property
    def layers(self) -> int:
        return len(self.kinds)

    @property
    def shape(self) -> str | None:
        """The :data:`SHAPES` name, where the model is one."""
        return self.name if self.name in SHAPES else None

    def dims(self) -> dict[str, int]:
        """The widths the transient uses: hidden, query heads, query / KV / MLP widths."""
        c = self.config
        heads = int(c.get("num_attention_heads") or 1)
        kv = int(c.get("num_key_value_heads") or heads)
        hd = int(c.get("head_dim") or c["hidden_size"] // heads)
        mlp = int(c.get("intermediate_size") or 0)
        if c.get("moe_intermediate_size") and c.get("num_experts_per_tok"):
            mlp = int(c["moe_intermediate_size"]) * int(c["num_experts_per_tok"])
        hidden = int(c["hidden_size"])
        return {"hidden": hidden, "heads": heads, "q": heads * hd, "kv": kv * hd, "mlp": mlp}

    def describe(self) -> str:
        c = self.config
        kinds = ", ".join(f"{self.kinds.count(k)} {k}" for k in dict.fromkeys(self.kinds))
        heads = int(c.get("num_attention_heads") or 1)
        kv = int(c.get("num_key_value_heads") or heads)
        hd = int(c.get("head_dim") or c["hidden_size"] // heads)
        return f"{c.get('model_type')}, {self.layers} layers ({kinds}), {kv} KV heads x {hd}"


def _classes(config: dict):
    from mlx_lm.utils import _get_classes

    return _get_classes(config)


def shrunk(config: dict, layers: int, query_heads: bool = False) -> dict:
    """``config`` with ``layers`` layers and every width the KV cache does not store made small:
    the vocabulary, the MLPs and (unless ``query_heads``) the query heads, one per KV head."""
    c = {k: v for k, v in config.items() if not k.startswith("quantization")}
    heads = int(c.get("num_attention_heads") or 1)
    kv = int(c.get("num_key_value_heads") or heads)
    hd = int(c.get("head_dim") or c["hidden_size"] // heads)
    q = heads if query_heads else kv
    c.update(num_hidden_layers=layers, vocab_size=VOCAB, tie_word_embeddings=True)
    for k, v in config.items():
        if k.endswith("intermediate_size") and isinstance(v, int):
            c[k] = 32
    if isinstance(c.get("layer_types"), list):
        c["layer_types"] = c["layer_types"][:layers]
    fields = {f.name for f in dataclasses.fields(_classes(c)[1])}
    if "kv_lora_rank" in c:  # latent attention: the latent's width is its own
        c.update(num_attention_heads=2, num_key_value_heads=2, hidden_size=64)
    elif "head_dim" in fields:
        c.update(num_attention_heads=q, head_dim=hd, hidden_size=64)
    else:
        c.update(num_attention_heads=q, hidden_size=q * hd)
    return c


def small_model(config: dict, layers: int, query_heads: bool = False):
    """The measurement model: :func:`shrunk`'s config, random weights in float32 (the CPU's
    fast matmuls; the caches store float16, as ``velox bench`` has them)."""
    import mlx.core as mx

    model_cls, args_cls = _classes(config)
    mx.random.seed(0)
    model = model_cls(args_cls.from_dict(shrunk(config, layers, query_heads)))
    model.set_dtype(mx.float32)
    mx.eval(model.parameters())
    return model


def kinds(model) -> list[str]:
    """Each layer's native cache: its class, and the window of a rotating one."""
    caches = model.make_cache() if hasattr(model, "make_cache") else None
    if caches is None:
        return ["KVCache"] * len(model.layers)
    out = []
    for c in caches:
        window = getattr(c, "max_size", None)
        out.append(type(c).__name__ + (f"({window})" if window else ""))
    return out


def shape_weights(config: dict, weights: str) -> int:
    """Bytes of mlx-lm's model at ``config`` in ``weights``: the parameters' ``nbytes``, nothing
    evaluated (``benchmarks/e2e.py`` builds its models so: bf16, then ``nn.quantize``)."""
    import mlx.core as mx
    import mlx.nn as nn
    from mlx.utils import tree_flatten

    model_cls, args_cls = _classes(config)
    model = model_cls(args_cls.from_dict(config))
    model.set_dtype(mx.float32 if weights == "fp32" else mx.bfloat16)
    if WEIGHTS[weights]:
        try:
            nn.quantize(model, group_size=64, bits=WEIGHTS[weights])
        except ValueError as e:
            raise ValueError(
                f"--weights {weights}: this shape cannot be quantized so ({e})"
            ) from None
    return int(sum(v.nbytes for _, v in tree_flatten(model.parameters())))


def _read_dir(path: Path) -> tuple[dict, int, str]:
    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        raise ValueError(f"{path}: no config.json (an mlx-lm model directory was expected)")
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ValueError(f"{path}: no *.safetensors weights")
    size = sum(f.stat().st_size for f in files)
    return json.loads(cfg_file.read_text()), size, f"{len(files)} safetensors file(s) in {path}"


def model_info(shape: str | None = None, model: str | None = None, weights: str = "4bit"):
    """The :class:`ModelInfo` of a shape in :data:`SHAPES` or of a model ``velox bench`` takes
    (a name, an mlx-lm directory; a GGUF is converted once, as bench converts it)."""
    from .models import NAMED, resolve

    if (shape is None) == (model is None):
        raise ValueError("give one of --shape and --model")
    if shape is not None:
        if shape not in SHAPES:
            raise ValueError(f"unknown shape {shape!r}: one of {', '.join(SHAPES)}")
        config = json.loads(json.dumps(SHAPES[shape]))  # a copy: mlx-lm may edit its dicts
        size = shape_weights(config, weights)
        where = f"mlx-lm's {shape} model in {weights} (its parameters' nbytes)"
        name = shape
    else:
        path = Path(model).expanduser()
        if model.lower() not in NAMED and not path.exists():
            raise ValueError(
                f"unknown model {model!r}: give a name ({', '.join(sorted(NAMED))}), an mlx-lm "
                f"directory or a .gguf file, or a --shape ({', '.join(SHAPES)})"
            )
        config, size, where = _read_dir(resolve(model))
        name = model
    layer_kinds = kinds(small_model(config, int(config["num_hidden_layers"])))
    return ModelInfo(name, config, size, where, layer_kinds)
