"""A GGUF's tokenizer, rebuilt for :func:`velox_cli.models.convert_gguf` as llama.cpp
tokenizes with its vocabulary: a byte-level BPE (``tokenizer.ggml.model = gpt2``) from its
merges, token types and pre-tokenizer name, or Gemma's SentencePiece vocabulary as a BPE with
byte fallback (see :mod:`velox_cli.models`).
"""

from __future__ import annotations

from pathlib import Path

from .gguf_model import _scalar

__all__: list[str] = []  # PRE_TOKENIZERS: velox_cli.models


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
