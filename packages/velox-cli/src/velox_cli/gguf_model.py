"""A GGUF's model, read for :func:`velox_cli.models.convert_gguf`: its metadata and weights
(``mx.load``, or the ``gguf`` package for the types MLX cannot decode), mlx-lm's
``config.json`` from its hyperparameters, and its weights dequantized, renamed to mlx-lm's
names and with llama.cpp's changes undone (see :mod:`velox_cli.models`).
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import numpy as np

__all__: list[str] = []  # ARCHITECTURES, MLX_GGUF_TYPES, gguf_summary: velox_cli.models


# GGUF architectures this converter maps onto mlx-lm model types.
ARCHITECTURES = {"gemma3": "gemma3_text", "llama": "llama"}


# llama.cpp's tensor names (per block, then global) -> mlx-lm's.
_BLOCK = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}


# Gemma 3's blocks (llama.cpp's gemma3 names, as gguf-py's tensor map gives them): four
# norms around attention and MLP, and per-head RMSNorms of queries and keys.
_GEMMA3_BLOCK = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "ffn_norm.weight": "pre_feedforward_layernorm.weight",
    "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}


_GLOBAL = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


_GGUF_HINT = 'pip install "velox-cli[gemma3]" (or pip install gguf)'


@dataclass(frozen=True)
class _Source:
    """A GGUF's metadata and weights. ``shapes`` in MLX's order (rows first: GGUF lists the
    fastest-varying dimension first), ``dense(name)`` one weight dequantized to float32."""

    meta: dict
    shapes: dict[str, tuple[int, ...]]
    dense: Callable[[str], mx.array]


# llama.cpp's tensor types (ggml_type) by number, and those MLX's GGUF reader decodes
_GGML_TYPES = {
    0: "F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 6: "Q5_0", 7: "Q5_1", 8: "Q8_0", 9: "Q8_1",
    10: "Q2_K", 11: "Q3_K", 12: "Q4_K", 13: "Q5_K", 14: "Q6_K", 15: "Q8_K", 16: "IQ2_XXS",
    17: "IQ2_XS", 18: "IQ3_XXS", 19: "IQ1_S", 20: "IQ4_NL", 21: "IQ3_S", 22: "IQ2_S",
    23: "IQ4_XS", 24: "I8", 25: "I16", 26: "I32", 27: "I64", 28: "F64", 29: "IQ1_M",
    30: "BF16", 34: "TQ1_0", 35: "TQ2_0",
}  # fmt: skip
# (Q4_0, Q4_1 and Q8_0 as affine codes, the others dequantized to float16; mx.load raises
# "gguf_tensor_to_f16 failed" on the rest: Q3_K, Q5_0, Q5_1, Q5_K, Q8_K, the IQ types)
MLX_GGUF_TYPES = ("F32", "F16", "BF16", "Q4_0", "Q4_1", "Q8_0", "Q2_K", "Q4_K", "Q6_K")
_GGUF_SCALARS = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}


def gguf_summary(gguf: Path) -> tuple[str | None, dict[str, int]]:
    """The architecture a GGUF file names (``general.architecture``) and how many tensors of
    each type it holds, read from its header alone (no tensor data, no gguf package). Raises
    ``ValueError`` for a file that is no GGUF or whose header runs past its end."""
    size = gguf.stat().st_size
    with open(gguf, "rb") as f:

        def take(n: int) -> bytes:
            b = f.read(n)
            if len(b) != n:
                raise ValueError(f"{gguf.name}: the GGUF header runs past the end of the file")
            return b

        def number(fmt: str) -> int:
            return struct.unpack("<" + fmt, take(struct.calcsize(fmt)))[0]

        def string() -> bytes:
            n = number("Q")
            if n > size:
                raise ValueError(f"{gguf.name}: a GGUF string of {n} bytes in a smaller file")
            return take(n)

        def skip(kind: int) -> None:
            if kind == 8:
                f.seek(min(number("Q"), size), 1)
            elif kind == 9:
                inner, count = number("I"), number("Q")
                if count > size:
                    raise ValueError(f"{gguf.name}: a GGUF array of {count} items")
                if inner in _GGUF_SCALARS:
                    f.seek(count * _GGUF_SCALARS[inner], 1)
                else:
                    for _ in range(count):
                        skip(inner)
            elif kind in _GGUF_SCALARS:
                f.seek(_GGUF_SCALARS[kind], 1)
            else:
                raise ValueError(f"{gguf.name}: unknown GGUF value type {kind}")

        if take(4) != b"GGUF":
            raise ValueError(f"{gguf.name}: not a GGUF file (no GGUF magic)")
        if number("I") < 2:
            raise ValueError(f"{gguf.name}: GGUF version 1 is not supported")
        tensors, kvs = number("Q"), number("Q")
        if tensors > size or kvs > size:
            raise ValueError(f"{gguf.name}: GGUF counts larger than the file")
        arch = None
        for _ in range(kvs):
            key, kind = string(), number("I")
            if key == b"general.architecture" and kind == 8:
                arch = string().decode("utf-8", "replace")
            else:
                skip(kind)
        types: dict[str, int] = {}
        for _ in range(tensors):
            string()
            dims = number("I")
            if dims > 8:
                raise ValueError(f"{gguf.name}: a GGUF tensor of {dims} dimensions")
            f.seek(8 * dims, 1)
            t = number("I")
            f.seek(8, 1)  # the data offset
            name = _GGML_TYPES.get(t, f"type {t}")
            types[name] = types.get(name, 0) + 1
    return arch, types


def _unreadable(gguf: Path, mlx_error: str) -> str:
    """Why MLX's GGUF reader refused ``gguf``, from the file's header: its architecture and
    the tensor types MLX cannot decode (its own message, ``gguf_tensor_to_f16 failed``, names
    neither). Raises ``ValueError`` where no reader would help: a header that cannot be read,
    an architecture velox does not convert."""
    try:
        arch, types = gguf_summary(gguf)
    except (OSError, ValueError) as e:
        raise ValueError(f"cannot read {gguf.name}: {e} (MLX: {mlx_error})") from None
    odd = {t: n for t, n in sorted(types.items()) if t not in MLX_GGUF_TYPES}
    kinds = ", ".join(f"{t} ({n} tensor{'s' * (n != 1)})" for t, n in odd.items())
    what = f"{gguf.name} (architecture {arch or 'not named'})"
    if arch not in ARCHITECTURES:
        raise ValueError(
            f"{what}: GGUF architecture {arch!r} is not supported; supported: "
            f"{', '.join(sorted(ARCHITECTURES))}"
        )
    if not odd:
        return f"cannot read {what} with MLX ({mlx_error})"
    return (
        f"{what} holds tensor types MLX's GGUF reader cannot decode: {kinds} (MLX reads "
        f"{', '.join(MLX_GGUF_TYPES)})"
    )


def _read(gguf: Path) -> _Source:
    """MLX's own reader where it decodes every tensor of the file, else the gguf package's."""
    try:
        tensors, meta = mx.load(str(gguf), return_metadata=True)
    except Exception as e:  # MLX's reader fails on a type it cannot decode (Q4_K, Q5_0...)
        return _read_with_gguf(gguf, _unreadable(gguf, str(e)))
    shapes = {}
    for name, w in tensors.items():
        if name.endswith((".scales", ".biases")):
            continue
        scales = tensors.get(_base(name) + ".scales")
        shapes[name] = tuple(w.shape) if scales is None else (w.shape[0], scales.shape[-1] * 32)
    return _Source(meta, shapes, lambda name: _dense(tensors, name))


def _read_with_gguf(gguf: Path, mlx_error: str) -> _Source:
    """The gguf package's reader (memory-mapped; numpy dequantizers for llama.cpp's block
    types, each tensor decoded when it is asked for)."""
    try:
        from gguf import GGUFReader, GGUFValueType
        from gguf.quants import dequantize
    except ImportError:
        raise ValueError(f"{mlx_error}; the gguf package reads them: {_GGUF_HINT}") from None
    try:
        reader = GGUFReader(str(gguf))
        meta = {
            field.name: _field_value(field, GGUFValueType)
            for field in reader.fields.values()
            if not field.name.startswith("GGUF.")  # the header: version, counts
        }
    except Exception as e:
        raise ValueError(f"cannot read {gguf.name}: {e}") from None
    tensors = {t.name: t for t in reader.tensors}
    shapes = {n: tuple(int(d) for d in reversed(t.shape.tolist())) for n, t in tensors.items()}

    def dense(name: str) -> mx.array:
        t = tensors[name]
        try:
            w = dequantize(t.data, t.tensor_type)
        except NotImplementedError:
            raise ValueError(
                f"{gguf.name}: tensor {name} is {t.tensor_type.name}, which the installed gguf "
                "package cannot dequantize (pip install -U gguf)"
            ) from None
        return mx.array(np.ascontiguousarray(w, dtype=np.float32).reshape(shapes[name]))

    return _Source(meta, shapes, dense)


def _field_value(field, kinds):
    """One metadata value from gguf's ``ReaderField`` (its ``parts`` / ``data`` / ``types``
    layout, as gguf 0.10 and later give it): a str, a Python number or bool, a list of str,
    or a numpy array of numbers."""
    kind = field.types[0]
    if kind == kinds.ARRAY:
        if field.types[-1] == kinds.STRING:
            return [bytes(field.parts[i]).decode("utf-8") for i in field.data]
        if not field.data:
            return np.zeros(0)
        return np.concatenate([np.atleast_1d(field.parts[i]) for i in field.data])
    value = field.parts[field.data[0]]
    if kind == kinds.STRING:
        return bytes(value).decode("utf-8")
    return value.tolist()[0]


def _scalar(meta: dict, key: str, default=None):
    v = meta.get(key, default)
    if isinstance(v, mx.array):
        return v.item()
    return v


def _config(gguf: Path, meta: dict, shapes: dict) -> dict:
    """mlx-lm's config.json from the GGUF's hyperparameters (keys ``<arch>.*``)."""
    arch = meta.get("general.architecture")
    if arch not in ARCHITECTURES:
        raise ValueError(
            f"{gguf.name}: GGUF architecture {arch!r} is not supported; supported: "
            f"{', '.join(sorted(ARCHITECTURES))}"
        )

    def need(key: str):
        v = _scalar(meta, f"{arch}.{key}")
        if v is None:
            raise ValueError(f"{gguf.name}: GGUF metadata lacks {arch}.{key}")
        return v

    hidden, heads = int(need("embedding_length")), int(need("attention.head_count"))
    head_dim = int(_scalar(meta, f"{arch}.attention.key_length", hidden // heads))
    rot = int(_scalar(meta, f"{arch}.rope.dimension_count", head_dim))
    if rot != head_dim:
        raise ValueError(
            f"{gguf.name}: RoPE on {rot} of {head_dim} head dimensions is not supported"
        )
    if "rope_freqs.weight" in shapes:
        raise ValueError(
            f"{gguf.name}: per-frequency RoPE factors (rope_freqs, Llama 3.1-style scaling) "
            "are not supported"
        )
    scaling = _scalar(meta, f"{arch}.rope.scaling.type", "none")
    rope_scaling = None
    if scaling == "linear":
        rope_scaling = {"type": "linear", "factor": float(need("rope.scaling.factor"))}
    elif scaling != "none":
        raise ValueError(f"{gguf.name}: RoPE scaling {scaling!r} is not supported (none or linear)")
    vocab = shapes["token_embd.weight"][0] if "token_embd.weight" in shapes else None
    if vocab is None:
        raise ValueError(f"{gguf.name}: no token_embd.weight tensor")
    tied = "output.weight" not in shapes
    if arch == "gemma3":
        config = _gemma3_config(gguf, meta, need, hidden, heads, head_dim, rope_scaling)
        config.update(vocab_size=int(vocab), tie_word_embeddings=tied)
    else:
        config = {
            "model_type": ARCHITECTURES[arch],
            "hidden_size": hidden,
            "num_hidden_layers": int(need("block_count")),
            "intermediate_size": int(need("feed_forward_length")),
            "num_attention_heads": heads,
            "num_key_value_heads": int(_scalar(meta, f"{arch}.attention.head_count_kv", heads)),
            "head_dim": head_dim,
            "rms_norm_eps": float(need("attention.layer_norm_rms_epsilon")),
            "vocab_size": int(vocab),
            # written as rope_theta, the key mlx-lm's ModelArgs read (a missing one is 10000)
            "rope_theta": float(_scalar(meta, f"{arch}.rope.freq_base", 10000.0)),
            "rope_traditional": False,
            "rope_scaling": rope_scaling,
            "max_position_embeddings": int(need("context_length")),
            "tie_word_embeddings": tied,
            "attention_bias": False,
            "mlp_bias": False,
        }
    eos = _scalar(meta, "tokenizer.ggml.eos_token_id")
    if eos is not None:
        config["eos_token_id"] = int(eos)
    return config


def _gemma3_config(
    gguf: Path, meta: dict, need, hidden: int, heads: int, head_dim: int, rope_scaling
) -> dict:
    """mlx-lm ``gemma3_text``'s config. The GGUF carries sizes, the global RoPE base, the
    norm epsilon and the sliding window; the rest is fixed for Gemma 3 and not written by
    llama.cpp's converter, so it is taken as llama.cpp's gemma3 loader
    (``src/llama-model.cpp``) and Google's published configs (``google/gemma-3-*``'s
    ``config.json``, transformers' ``Gemma3TextConfig`` defaults) have it."""
    arch = "gemma3"
    key_dim = head_dim
    value_dim = int(_scalar(meta, f"{arch}.attention.value_length", key_dim))
    if value_dim != key_dim:
        raise ValueError(
            f"{gguf.name}: key head dim {key_dim} and value head dim {value_dim} differ; "
            "mlx-lm's gemma3_text has one head dim"
        )
    for key in ("final_logit_softcapping", "attn_logit_softcapping"):
        cap = _scalar(meta, f"{arch}.{key}")
        if cap:  # Gemma 2 had them; Gemma 3 has neither, nor mlx-lm's gemma3_text
            raise ValueError(
                f"{gguf.name}: {arch}.{key} = {cap} is not supported (mlx-lm's gemma3_text "
                "has no logit soft-capping)"
            )
    layers = int(need("block_count"))
    window = int(_scalar(meta, f"{arch}.attention.sliding_window", 0) or 0)
    return {
        "model_type": ARCHITECTURES[arch],
        "hidden_size": hidden,
        "num_hidden_layers": layers,
        "intermediate_size": int(need("feed_forward_length")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(_scalar(meta, f"{arch}.attention.head_count_kv", heads)),
        "head_dim": head_dim,
        "rms_norm_eps": float(need("attention.layer_norm_rms_epsilon")),
        # global layers' RoPE base; Gemma 3's config and Gemma3TextConfig default: 1e6
        "rope_theta": float(_scalar(meta, f"{arch}.rope.freq_base", 1_000_000.0)),
        # sliding layers' RoPE base, not in the GGUF: 10000 in Gemma 3's configs
        # ("rope_local_base_freq": 10000.0) and in llama.cpp (rope_freq_base_train_swa)
        "rope_local_base_freq": 10_000.0,
        # linear scaling of the global layers' RoPE (Gemma 3 4B-27B: factor 8; 270M, 1B: none)
        "rope_scaling": rope_scaling,
        # attention scale 1/sqrt(query_pre_attn_scalar): the head dim (256) for Gemma 3 270M,
        # 1B, 4B and 12B, hidden / heads (168) for 27B (62 layers), as Google's configs and
        # llama.cpp (f_attention_scale, by its layer count) have it
        "query_pre_attn_scalar": hidden // heads if layers == 62 else head_dim,
        # every 6th layer global, the other five sliding: Gemma 3's configs
        # ("sliding_window_pattern": 6, its layer_types) and llama.cpp (set_swa_pattern(6));
        # a file without a window (llama.cpp then runs every layer global) gets pattern 1
        "sliding_window": window if window > 0 else int(need("context_length")),
        "sliding_window_pattern": 6 if window > 0 else 1,
        "max_position_embeddings": int(need("context_length")),
        # informative: mlx-lm's gemma3_text hard-codes the tanh GELU of Gemma 3's configs
        "hidden_activation": "gelu_pytorch_tanh",
    }


def _base(name: str) -> str:
    return name[: -len(".weight")] if name.endswith(".weight") else name


def _dense(tensors: dict, name: str) -> mx.array:
    """One GGUF weight as float32: MLX gives a quantized one as affine codes (uint32 words
    ``(rows, cols * bits / 32)``) with ``.scales`` and ``.biases`` of shape
    ``(rows, cols / 32)``, a float one as it is."""
    base = _base(name)
    w = tensors[name]
    scales = tensors.get(base + ".scales")
    if scales is None:
        return w.astype(mx.float32)
    cols = scales.shape[-1] * 32
    bits = w.shape[-1] * 32 // cols
    return mx.dequantize(
        w,
        scales.astype(mx.float32),
        tensors[base + ".biases"].astype(mx.float32),
        group_size=32,
        bits=bits,
    )


def _unpermute(w: mx.array, heads: int) -> mx.array:
    """Undo llama.cpp's Q/K row order. Shapes: ``w (heads * head_dim, in)``. llama.cpp
    stores each head's rows as pairs ``(i, i + head_dim / 2)`` interleaved (row ``2i`` and
    ``2i + 1``); mlx-lm's RoPE wants the two halves in order."""
    rows = w.shape[0]
    d = rows // heads
    return w.reshape(heads, d // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _weights(gguf: Path, src: _Source, config: dict, dtype: mx.Dtype) -> dict[str, mx.array]:
    """mlx-lm's weights. A llama's Q/K rows are put back in mlx-lm's order (llama.cpp's
    converter permutes them for its adjacent-pair RoPE); Gemma's are not permuted (llama.cpp
    runs Gemma with NeoX-style RoPE, as mlx-lm does), but every Gemma RMSNorm weight is stored
    plus 1 (llama.cpp's norm multiplies by the weight, Gemma's by ``1 + w``), which is taken
    off again for mlx-lm's ``gemma3_text``, whose norm adds the 1."""
    gemma = config["model_type"] == "gemma3_text"
    block = _GEMMA3_BLOCK if gemma else _BLOCK
    out: dict[str, mx.array] = {}
    unknown = []
    for name in src.shapes:
        if name in _GLOBAL:
            target = _GLOBAL[name]
        elif name.startswith("blk.") and name.split(".", 2)[2] in block:
            _, layer, rest = name.split(".", 2)
            target = f"model.layers.{int(layer)}.{block[rest]}"
        else:
            unknown.append(name)
            continue
        w = src.dense(name)
        if gemma:
            if name.endswith("norm.weight"):
                w = w - 1.0
        elif target.endswith("q_proj.weight"):
            w = _unpermute(w, config["num_attention_heads"])
        elif target.endswith("k_proj.weight"):
            w = _unpermute(w, config["num_key_value_heads"])
        out[target] = w.astype(dtype)
        mx.eval(out[target])
    if unknown:
        raise ValueError(
            f"{gguf.name}: tensors this converter does not map: {', '.join(sorted(unknown)[:6])}"
            + (" ..." if len(unknown) > 6 else "")
        )
    expected = 2 + len(block) * config["num_hidden_layers"] + (not config["tie_word_embeddings"])
    if len(out) != expected:
        raise ValueError(f"{gguf.name}: {len(out)} weight tensors, expected {expected}")
    return out
