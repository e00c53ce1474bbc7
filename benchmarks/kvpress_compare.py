"""velox's eviction methods against NVIDIA kvpress's presses, on the same long-context prompts.

What it measures: for each press velox also implements (SnapKV, StreamingLLM, Ada-KV over
SnapKV, KNorm, TOVA, PyramidKV) and each compression ratio ``r``, the accuracy of kvpress's
press and of velox's method on the suite's prompts (:mod:`velox_cli.longctx.tasks`, the same
tokenizer, seed, tasks, lengths and count as ``velox eval``), side by side; the per-prompt
agreement (the share of prompts both score alike, and of identical answers); and, on the first
``--overlap`` prompts of each task and length, the overlap of the context positions each side
keeps (Jaccard per layer and KV head, averaged). kvpress's no-press run (full cache) and
velox's ``fp16`` run are the baselines.

The protocol is kvpress's on both sides: the context is prefilled with the compression
active, then the question (and answer prefix) is fed without it, then ``max_new`` tokens are
decoded greedily; answers are cut at the first EOS, decoded with the suite's tokenizer and
scored with ``Prompt.score`` (RULER's string match). velox prefills each context in one
chunk by default (``--chunk 0``), as kvpress runs it through the model in one forward pass: a
retention policy cuts a context prefilled in chunks as each next chunk arrives, so a later
chunk attends to the kept part of the earlier ones in a compressed layer and the layers above
compute other keys (:func:`prefill_chunk`); a ``--chunk`` below the context measures velox's
chunked prefill instead.

- kvpress: the model is loaded in transformers from the GGUF velox converts
  (``AutoModelForCausalLM.from_pretrained(folder, gguf_file=name)``, float32, SDPA
  attention); each press is kvpress's own (``SnapKVPress``, ``StreamingLLMPress``,
  ``AdaKVPress(SnapKVPress)``, their default settings at ``compression_ratio=r``), used as a
  context manager around the context's prefill (``model.model(context)``, compressed at its
  end); the question then runs at positions after the full context and the answer is decoded
  token by token, as ``KVPressTextGenerationPipeline`` does (its ``preprocess`` would apply
  the chat template and re-tokenize, so the token ids are fed directly).
- velox: :func:`velox_cli.longctx.run.run_eval` with ``question="after"`` and the specs
  ``snapkv:budget=P%``, ``streamingllm:budget=P%``, ``adakv:budget=P%``, ``P = 100 (1 - r)``
  of the context's tokens (velox's defaults); with ``--matched`` also SnapKV, Ada-KV,
  PyramidKV and ChunkKV with kvpress's vote settings (``observe=64,kernel=5,pooling=avg``;
  Ada-KV ``window=64``; ChunkKV ``chunk_length=20``) and CurDKV with CURPress's exact squared
  norms (``sketch=0``: its ``use_random_leverage=False``), which separates the settings from
  the implementations.

kvpress's ``KVzipPress`` scores the context by reconstructing it after the prefill (the
context manager runs its repeat passes on exit) and masks the pruned keys, as ``AdaKVPress``
does; velox's ``kvzip:budget=P%`` runs ``velox_kvzip.compress`` after the context's prefill
(:func:`velox_cli.longctx.run.prompt_caches`). kvpress loads the tokenizer by the model's
name; here it gets the GGUF's without its chat template (the prompts are raw text), so both
sides repeat with ``"\n\nRepeat the previous context exactly."`` then ``"\n"``.

Gemma 3 (``--model gemma3``): velox compresses its 3 global layers and leaves the 15
sliding-window layers to mlx-lm's ``RotatingKVCache``. kvpress 0.5.5 does the same for
``Gemma3ForConditionalGeneration`` (its ``BasePress.__call__`` hooks no sliding layer) but
hooks every layer of the text-only ``Gemma3ForCausalLM`` that transformers loads from the
GGUF, so the kvpress half restricts each press to the global layers
(``_global_layers_only``): a subclass whose ``compress`` returns a sliding layer's keys and
values untouched (the hook writes them back as they were) and otherwise runs the press's own
``compress``; the scores, the budget per layer and the selection are kvpress's. One more
change: transformers 5.2's Gemma 3 rotary embedding takes the layer type (the global layers'
RoPE base differs from the sliding ones'), which ``ExpectedAttentionPress.apply_avg_rope``
does not pass (it fails on Gemma 3 with ``no attribute 'None_inv_freq'``), so the press gets
the layer's own RoPE as ``module.rotary_emb`` while it compresses. Ada-KV on this model is
SnapKV (one KV head per layer: nothing to share across heads). ``PyramidKVPress`` places a
layer by its index among all 18 (``module.layer_idx`` over ``num_hidden_layers``): where its
pyramid applies, layers 5, 11 and 17 get the 18-layer pyramid's budgets at those places, on
average below the stated share (at ratio 0.5 of a 4,000-token context 2,782, 1,441 and 100
tokens against 2,000; velox's pyramid spans the 3 global layers, averaging the share); at
ratio 0.75 below 5,120 context tokens its top layer's share is below its window and it keeps
SnapKV's uniform budget. Kept positions and their overlap are those of the global layers,
also per layer (``jaccard_layers``).

KVzip on Gemma 3: kvpress 0.5.5's ``KVzipPress`` refuses Gemma 3 (``"KVzipPress is not
supported for Gemma3ForCausalLM"``). The kvpress half then runs it through
``_Gemma3KVzipPress``, which lifts that refusal and changes one thing:
``compress_post`` ranks and masks the global layers only (kvpress's own code, applied to the
layers whose ``self_attn.is_sliding`` is False; the sliding layers' scores, which kvpress would
rank with the rest, are left out and nothing of theirs is masked). The reconstruction passes,
the scores and the pruning rule are kvpress's: its hooks score every layer and cut each one's
cache back to the context after every pass, so the sliding layers see the context as the
prefill left it, as velox restores them. KVzipPress encodes its instructions with
the tokenizer it loads; transformers 5.2 builds Gemma 3's from the GGUF into other pieces than
velox's (16 ids for the first instruction against velox's 7, one per word), so the
worker hands KVzipPress velox's ids for its own texts, as the prompts themselves go (SmolLM2's
tokenize alike either way).

Not compared: kvpress's ``QFilterPress`` downloads its filters from the Hugging Face Hub
(``nthngdy/<model>_qfilt``, none for SmolLM2) and this benchmark runs offline.

kvpress's ``TOVAPress`` compresses the context once and keeps its last token, so velox's
counterpart is ``tova:budget=P%,every=None,window=1`` (velox's TOVA evicts at every decode
step by default, as the paper does). kvpress's ``PyramidKVPress`` falls back to a uniform
budget (SnapKV's) whenever its top layer's share is below its window (64 tokens; with
``beta=20``, below an average of 1,280 kept tokens); velox's keeps the pyramid at every budget
(docs/pyramidkv.md).

Kept positions: kvpress's scorer presses gather the kept keys, which are matched row by row
to the no-press run's keys of the same prompt; ``AdaKVPress`` keeps every key and masks the
pruned ones (``masked_key_indices`` on each attention module), its kept set is the rest.
velox's caches hold the absolute positions of what they keep (``body_positions``, sinks and
window); they are read after the question's prefill (the context as the question saw it) and
after the first decoded token (``velox_decode_kept``: the same set, since
:func:`velox_cli.longctx.run.prompt_caches` holds the question whole and cuts nothing more).

Two environments: kvpress 0.5.5 requires ``transformers<5.3`` and mlx-lm 0.32.2
``transformers>=5.7``, so no environment holds both. This script runs in velox's
environment and starts itself in kvpress's (``--kvpress-python``: torch, transformers,
kvpress, gguf) for the kvpress half; the prompts go there as token ids in a JSON file and the
generated token ids (and the kept positions as packed bit masks) come back. That worker runs
in the background while the velox half runs (with ``--threads 1`` and ``--jobs 1``, one core
each).

    nox -s kvpress
    python benchmarks/kvpress_compare.py --kvpress-python /tmp/kvpress-venv/bin/python \\
        --tasks passkey multikey --lengths 2048 --prompts 8 --ratios 0.75 0.5 \\
        --json out/kvpress_compare.json
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Any

import numpy as np

PRESSES = (
    "snapkv",
    "streamingllm",
    "adakv",
    "knorm",
    "tova",
    "pyramidkv",
    "chunkkv",
    "expected-attention",
    "kvzip",
    "curdkv",
)
# velox's counterpart of each press: its defaults, and kvpress's vote settings (--matched)
VELOX_SPECS = {
    "snapkv": "snapkv:budget={p}%",
    "streamingllm": "streamingllm:budget={p}%",
    "adakv": "adakv:budget={p}%",
    "knorm": "knorm:budget={p}%",
    # kvpress's TOVAPress compresses the context only and always keeps its last token
    "tova": "tova:budget={p}%,every=None,window=1",
    "pyramidkv": "pyramidkv:budget={p}%",
    "chunkkv": "chunkkv:budget={p}%",
    "expected-attention": "expected-attention:budget={p}%",
    # kvpress's KVzipPress defaults: 4 sinks, 2,048-token chunks, one ranking of every layer
    "kvzip": "kvzip:budget={p}%",
    # CURPress's scorer (4 sinks, key x value leverage, 16-token windows), with velox's
    # Gaussian sketch of r = 20 columns (CURPress's default skips it: --matched, sketch=0)
    "curdkv": "curdkv:budget={p}%",
}
MATCHED_SPECS = {
    "snapkv": "snapkv:budget={p}%,observe=64,kernel=5,pooling=avg",
    "adakv": "adakv:budget={p}%,window=64,observe=64,kernel=5,pooling=avg",
    "pyramidkv": "pyramidkv:budget={p}%,observe=64,kernel=5,pooling=avg",
    # kvpress's ChunkKVPress around its SnapKVPress: 20-token chunks, SnapKV's vote settings
    "chunkkv": "chunkkv:budget={p}%,chunk_length=20,observe=64,kernel=5,pooling=avg",
    # CURPress's use_random_leverage=False: the exact squared norms
    "curdkv": "curdkv:budget={p}%,sketch=0",
}
KVPRESS_LABELS = {
    "snapkv": "SnapKVPress",
    "streamingllm": "StreamingLLMPress",
    "adakv": "AdaKVPress(SnapKVPress)",
    "knorm": "KnormPress",
    "tova": "TOVAPress",
    "pyramidkv": "PyramidKVPress",
    "chunkkv": "ChunkKVPress(SnapKVPress)",
    "expected-attention": "ExpectedAttentionPress",
    "kvzip": "KVzipPress",
    "curdkv": "CURPress",
}


# KVzipPress's first repeat instruction (velox-kvzip's default prompt); both sides must
# tokenize it alike for the kept positions to be comparable
KVZIP_PROMPT = "\n\nRepeat the previous context exactly."
# the texts KVzipPress encodes without a chat template: its two instructions and its suffix
# (velox-kvzip's defaults), and the empty template prefix
KVZIP_TEXTS = (
    KVZIP_PROMPT,
    "\n\nRepeat the part of the previous context exactly, starting with",
    "\n",
    "",
)


def _share(ratio: float) -> str:
    """The budget share velox keeps at kvpress's compression ratio, as ``budget=P%`` writes it."""
    return f"{round(100 * (1 - ratio), 6):g}"


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# -- the kvpress half (runs in kvpress's environment: torch, transformers, kvpress) ------------


def load_job_model(job_path: str):
    """A worker's job (JSON: ``gguf``, ``threads``, ...) and its GGUF loaded in transformers
    as the kvpress half runs it (float32, SDPA attention), with torch at the job's threads."""
    import torch
    import transformers
    from transformers import AutoModelForCausalLM

    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    job = json.loads(Path(job_path).read_text())
    if job["threads"]:
        torch.set_num_threads(job["threads"])
    gguf = Path(job["gguf"])
    t0 = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(
        str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32, attn_implementation="sdpa"
    ).eval()
    _log(f"kvpress: {gguf.name} loaded in transformers ({time.perf_counter() - t0:.1f} s)")
    return job, model


def _kvpress_worker(job_path: str, out_path: str) -> None:
    """Every press at every ratio on every prompt of the job, plus the no-press run; writes
    the generated token ids (JSON) and the kept context positions (``.npz`` beside it)."""
    import kvpress
    import torch
    import transformers
    from kvpress import (
        AdaKVPress,
        ChunkKVPress,
        CURPress,
        ExpectedAttentionPress,
        KnormPress,
        KVzipPress,
        PyramidKVPress,
        SnapKVPress,
        StreamingLLMPress,
        TOVAPress,
    )
    from transformers import AutoTokenizer, DynamicCache

    job, model = load_job_model(job_path)
    gguf = Path(job["gguf"])
    layers = model.model.layers
    # KVzipPress loads the tokenizer by the model's name (a folder holding only the GGUF
    # here): it gets the GGUF's, without its chat template, as the suite's prompts are raw
    # text (no template prefix; the repeat instruction followed by "\n", kvpress's suffix
    # without a template)
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    tokenizer.chat_template = None
    own_ids = tokenizer.encode(KVZIP_PROMPT, add_special_tokens=False)
    texts = job.get("texts") or {}

    class _Shim:
        """The GGUF's tokenizer, giving velox's ids for KVzipPress's own texts (the prompts
        come as velox's ids already): transformers 5.2 builds Gemma 3's tokenizer from the
        GGUF without its merges and splits the instruction into 16 pieces, velox into 7
        (SmolLM2's tokenize alike either way)."""

        chat_template = None

        @staticmethod
        def encode(text, return_tensors=None, add_special_tokens=True):
            if text not in texts:
                return tokenizer.encode(
                    text, return_tensors=return_tensors, add_special_tokens=add_special_tokens
                )
            ids = [*([tokenizer.bos_token_id] if add_special_tokens else []), *texts[text]]
            return torch.tensor([ids], dtype=torch.long) if return_tensors == "pt" else ids

    class _Tokenizer:
        @staticmethod
        def from_pretrained(*args, **kwargs):
            return _Shim

    kvpress.presses.kvzip_press.AutoTokenizer = _Tokenizer
    # the layers a press compresses: all but Gemma 3's sliding-window ones (velox leaves those
    # to mlx-lm's RotatingKVCache)
    scored = [i for i, lay in enumerate(layers) if not getattr(lay.self_attn, "is_sliding", False)]
    gemma3 = model.config.model_type.startswith("gemma3")
    if gemma3:
        kvzip_module = kvpress.presses.kvzip_press

        class _Gemma3KVzipPress(KVzipPress):
            """kvpress's KVzipPress on Gemma 3's global layers (0.5.5 refuses Gemma 3): its
            reconstruction and scores unchanged; the ranking and the masks over the global
            layers alone (kvpress's ``compress_post`` on those layers)."""

            @contextmanager
            def __call__(self, model):
                refused = kvzip_module.Gemma3PreTrainedModel
                kvzip_module.Gemma3PreTrainedModel = type("_NotGemma3", (), {})
                try:
                    with KVzipPress.__call__(self, model):
                        kvzip_module.Gemma3PreTrainedModel = refused
                        yield
                finally:
                    kvzip_module.Gemma3PreTrainedModel = refused

            def compress_post(self, model):
                if self.compression_ratio <= 0:
                    return
                mods = [model.model.layers[i].self_attn for i in scored]
                for layer in model.model.layers:
                    layer.self_attn.masked_key_indices = None
                sv = self.score_val[scored]
                sv[..., : self.n_sink] = sv.amax() + 1.0
                n_layer, bsz, heads, ctx_len = sv.shape
                if self.layerwise:
                    nl = int(bsz * heads * ctx_len * self.compression_ratio)
                    n_pruned_layers = nl * torch.ones(n_layer, dtype=torch.int)
                else:
                    n_pruned = int(sv.numel() * self.compression_ratio)
                    pruned = torch.topk(-sv.reshape(-1), n_pruned).indices
                    per_layer = bsz * heads * ctx_len
                    n_pruned_layers = torch.bincount(pruned // per_layer, minlength=n_layer).int()
                for j, module in enumerate(mods):
                    n_pruned = n_pruned_layers[j].cpu()
                    indices = torch.topk(-sv[j].reshape(bsz, -1), n_pruned, dim=1).indices
                    indices = indices.flatten().cpu()
                    batch = torch.arange(bsz).repeat_interleave(n_pruned)
                    module.masked_key_indices = (batch, indices // ctx_len, indices % ctx_len)

        class _LayerRope(torch.nn.Module):
            """Gemma 3's rotary embedding for one layer type: transformers 5.2's takes the
            type as an argument (one RoPE base for sliding layers, another for global ones),
            which ``ExpectedAttentionPress.apply_avg_rope`` does not pass."""

            def __init__(self, rope, layer_type: str):
                super().__init__()
                self.rope, self.layer_type = rope, layer_type

            def forward(self, x, position_ids):
                return self.rope(x, position_ids, layer_type=self.layer_type)

        global_only: dict[type, type] = {}

        def _global_layers_only(press):
            """``press`` (kvpress's, unchanged otherwise) compressing Gemma 3's global layers
            alone: its ``compress`` returns a sliding layer's keys and values untouched (the
            hook writes them back as they were), and runs on a global layer with the
            layer's own RoPE as ``module.rotary_emb``."""
            cls = type(press)
            if cls not in global_only:

                def compress(self, module, hidden_states, keys, values, attentions, kwargs):
                    if module.is_sliding:
                        return keys, values
                    rope = module.rotary_emb
                    kind = model.config.layer_types[module.layer_idx]
                    module.rotary_emb = _LayerRope(rope, kind)
                    try:
                        return cls.compress(
                            self, module, hidden_states, keys, values, attentions, kwargs
                        )
                    finally:
                        module.rotary_emb = rope

                global_only[cls] = type(f"_Gemma3{cls.__name__}", (cls,), {"compress": compress})
            press.__class__ = global_only[cls]
            return press

    stop = set(job["eos"])
    gen_eos = model.generation_config.eos_token_id
    stop.update(gen_eos if isinstance(gen_eos, list) else [gen_eos] if gen_eos is not None else [])

    def make(name: str, ratio: float):
        press = make_press(name, ratio)
        return _global_layers_only(press) if gemma3 and name != "kvzip" else press

    def make_press(name: str, ratio: float):
        if name == "snapkv":
            return SnapKVPress(compression_ratio=ratio)
        if name == "streamingllm":
            return StreamingLLMPress(compression_ratio=ratio)
        if name == "adakv":
            return AdaKVPress(SnapKVPress(compression_ratio=ratio))
        if name == "knorm":
            return KnormPress(compression_ratio=ratio)
        if name == "tova":
            return TOVAPress(compression_ratio=ratio)
        if name == "pyramidkv":
            return PyramidKVPress(compression_ratio=ratio)
        if name == "chunkkv":
            return ChunkKVPress(press=SnapKVPress(compression_ratio=ratio), chunk_length=20)
        if name == "expected-attention":
            return ExpectedAttentionPress(compression_ratio=ratio)
        if name == "kvzip":
            return (_Gemma3KVzipPress if gemma3 else KVzipPress)(compression_ratio=ratio)
        if name == "curdkv":
            return CURPress(compression_ratio=ratio)
        raise ValueError(f"unknown press {name!r}")

    @torch.inference_mode()
    def run(press, context: list[int], question: list[int], max_new: int):
        """kvpress's protocol: the context prefilled under the press, the question and the
        greedy answer without it. Returns the answer's ids, the cache's keys after the
        context (one ``(1, H, n, D)`` tensor per layer) and AdaKV's pruned indices."""
        cache = DynamicCache()
        with press(model) if press is not None else nullcontext():
            model.model(input_ids=torch.tensor([context]), past_key_values=cache)
        keys = [cache.layers[i].keys for i in range(len(layers))]
        pruned = [getattr(layer.self_attn, "masked_key_indices", None) for layer in layers]
        n = len(context)
        if len({k.shape[2] for k in keys}) == 1:
            out = model(
                input_ids=torch.tensor([question]),
                past_key_values=cache,
                position_ids=torch.arange(n, n + len(question))[None],
                logits_to_keep=1,
            )
        else:  # per-layer lengths (PyramidKVPress): one causal mask cannot serve every layer
            for i, t in enumerate(question):  # one token at a time needs none
                out = model(
                    input_ids=torch.tensor([[t]]),
                    past_key_values=cache,
                    position_ids=torch.tensor([[n + i]]),
                )
        ids = [int(out.logits[0, -1].argmax())]
        at = n + len(question)
        while len(ids) < max_new and ids[-1] not in stop:
            out = model(
                input_ids=torch.tensor([[ids[-1]]]),
                past_key_values=cache,
                position_ids=torch.tensor([[at]]),
            )
            ids.append(int(out.logits[0, -1].argmax()))
            at += 1
        return ids, keys, pruned

    def kept_mask(full: list, keys: list, pruned: list) -> np.ndarray:
        """``(L, H, n)`` bool: the context positions each layer and KV head keeps."""
        rows = []
        for f, k, p in zip(full, keys, pruned):
            h, n = f.shape[1], f.shape[2]
            m = np.zeros((h, n), dtype=bool)
            if p is not None:  # AdaKVPress: every key stays, the pruned ones are masked
                m[:] = True
                b, hh, ss = (t.cpu().numpy() for t in p)
                m[hh[b == 0], ss[b == 0]] = False
            elif k.shape[2] == n:
                m[:] = True
            else:  # a scorer press gathered the kept keys: find each in the full keys
                where = torch.cdist(k[0].float(), f[0].float()).argmin(-1).cpu().numpy()
                for i in range(h):
                    m[i, where[i]] = True
            rows.append(m)
        return np.stack(rows)

    overlap = set(job["overlap"])
    results, masks = [], {}
    t_all = time.perf_counter()
    for j, p in enumerate(job["prompts"]):
        t_p = time.perf_counter()
        ids, full, _ = run(None, p["context"], p["question"], p["max_new"])
        results.append({"key": p["key"], "press": "none", "ratio": 0.0, "ids": ids})
        for name in job["presses"]:
            for ratio in job["ratios"]:
                t = time.perf_counter()
                ids, keys, pruned = run(
                    make(name, ratio), p["context"], p["question"], p["max_new"]
                )
                row = {"key": p["key"], "press": name, "ratio": ratio, "ids": ids}
                row["seconds"] = round(time.perf_counter() - t, 2)
                m = kept_mask(*([x[i] for i in scored] for x in (full, keys, pruned)))
                row["kept_per_head"] = float(m.sum(-1).mean())
                if p["key"] in overlap:
                    row["mask"] = f"m{len(masks)}"
                    masks[row["mask"]] = np.packbits(m, axis=-1)
                results.append(row)
        _log(
            f"kvpress: prompt {j + 1}/{len(job['prompts'])} {p['key']} "
            f"({time.perf_counter() - t_p:.0f} s)"
        )
    info = {
        "kvpress": getattr(kvpress, "__version__", None) or _version("kvpress"),
        "transformers": transformers.__version__,
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "attention": model.config._attn_implementation,
        "repeat_prompt_ids": _Shim.encode(KVZIP_PROMPT, add_special_tokens=False),
        "own_repeat_prompt_ids": own_ids,
        "layers": scored,
        "seconds": round(time.perf_counter() - t_all, 1),
    }
    np.savez_compressed(Path(out_path).with_suffix(".npz"), **masks)
    Path(out_path).write_text(json.dumps({"info": info, "runs": results}))


def _version(dist: str) -> str | None:
    from importlib import metadata

    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


# -- the velox half (velox's environment: MLX, mlx-lm, velox) ----------------------------------


def _preload_blas() -> None:
    """Re-execute this script once with a fast BLAS preloaded where MLX would compute with its
    bundled reference BLAS (as the ``velox`` command does: :mod:`velox_cli.blas`)."""
    from velox_cli import blas
    from velox_core import environment

    if (
        sys.platform != "linux"
        or (environment.get("VELOX_BLAS") or "").lower() in blas.OFF
        or environment.get(blas.ACTIVE)
        or "blas" in os.environ.get("LD_PRELOAD", "").lower()
        or blas.mlx_reference_blas() is None
    ):
        return
    lib, what, reasons = blas.find_blas()
    if lib is None:
        _log(f"kvpress_compare: MLX keeps its reference BLAS (slow): {'; '.join(reasons)}")
        return
    _log(f"kvpress_compare: preloading {what} for MLX")
    env = environment.with_setting(**{blas.ACTIVE: str(lib)})
    pre = env.get("LD_PRELOAD", "")
    env["LD_PRELOAD"] = f"{lib}:{pre}" if pre else str(lib)
    env.setdefault("OPENBLAS_NUM_THREADS", "1")
    os.execve(sys.executable, [sys.executable, os.path.abspath(__file__), *sys.argv[1:]], env)


def _kept_positions(caches: list, n: int) -> np.ndarray | None:
    """``(L, H, n)`` bool: the context positions (``< n``) each velox cache holds per KV
    head, from its sinks, window and body positions, over the layers velox compresses (the
    model's own caches, Gemma 3's sliding-window layers, left out); None where none does."""
    rows = []
    for c in caches:
        if getattr(c, "policy", None) is None:  # the model's own caches; velox's without a cut
            continue
        m = np.zeros((c.kv_heads, n), dtype=bool)
        sinks, window = c.policy_view.protected()
        fixed = np.concatenate([np.array(sinks.positions), np.array(window.positions)])
        fixed = fixed.astype(np.int64)
        m[:, fixed[fixed < n]] = True
        for h, pos in enumerate(c.policy_view.body_positions()):
            if pos is not None:
                q = np.array(pos[0]).astype(np.int64)
                m[h, q[q < n]] = True
        rows.append(m)
    return np.stack(rows) if rows else None


def _velox_masks(model, store, prompt, spec: str, chunk: int, tokenizer):
    """velox's kept context positions for one prompt: after the question's prefill, and after
    the first decoded token (the prompt path of ``velox_cli.longctx.run``, question after;
    ``tokenizer`` for a method's step after the prefill, KVzip's)."""
    import mlx.core as mx

    from velox_cli.longctx.run import budget_tokens, prompt_caches, resolve_spec
    from velox_cli.specs import build_caches, parse
    from velox_core import routed

    caches = build_caches(parse(resolve_spec(spec, budget_tokens(prompt, "after"))), model, store)
    n = len(prompt.context)
    with routed(model):
        logits = prompt_caches(model, caches, prompt, "after", chunk, tokenizer, CUT)
        at_question = _kept_positions(caches, n)
        y = mx.argmax(logits, axis=-1)
        mx.eval(model(y[:, None], cache=caches))
        at_decode = _kept_positions(caches, n)
    return at_question, at_decode


def _jaccard(a: np.ndarray, b: np.ndarray) -> float:
    """Jaccard index of two ``(L, H, n)`` kept sets, per layer and head, averaged."""
    return float(np.mean(_jaccard_layers(a, b)))


def _jaccard_layers(a: np.ndarray, b: np.ndarray) -> list[float]:
    """Jaccard index of two ``(L, H, n)`` kept sets per layer (averaged over its heads)."""
    inter = (a & b).sum(-1)
    union = (a | b).sum(-1)
    return np.mean(np.where(union > 0, inter / np.maximum(union, 1), 1.0), axis=-1).tolist()


def _mean(xs: list[float]) -> float | None:
    xs = [x for x in xs if x is not None and np.isfinite(x)]
    return float(np.mean(xs)) if xs else None


def _cut(ids: list[int], eos: set[int]) -> list[int]:
    for i, t in enumerate(ids):
        if t in eos:
            return ids[:i]
    return ids


def _cell(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Accuracy of both sides and their per-prompt agreement over ``rows`` (one per prompt)."""
    ok = [r for r in rows if r["velox_score"] is not None]
    out: dict[str, Any] = {
        "prompts": len(rows),
        "kvpress_accuracy": _mean([r["kvpress_score"] for r in rows]),
        "velox_accuracy": _mean([r["velox_score"] for r in ok]),
        "agreement": _mean([float(r["kvpress_score"] == r["velox_score"]) for r in ok]),
        "same_answer": _mean([float(r["kvpress_output"] == r["velox_output"]) for r in ok]),
        "velox_errors": len(rows) - len(ok),
    }
    if "matched_score" in rows[0]:
        out["matched_accuracy"] = _mean([r["matched_score"] for r in rows])
        out["matched_agreement"] = _mean(
            [float(r["kvpress_score"] == r["matched_score"]) for r in rows]
        )
    per_layer = [r["jaccard_layers"] for r in rows if r.get("jaccard_layers") is not None]
    if per_layer:
        out["jaccard_layers"] = np.mean(per_layer, axis=0).tolist()
    for k in (
        "kvpress_kept",
        "velox_budget",
        "velox_question_kept",
        "velox_decode_kept",
        "jaccard",
        "jaccard_decode",
        "matched_jaccard",
    ):
        vals = [r[k] for r in rows if r.get(k) is not None]
        if vals:
            out[k] = float(np.mean(vals))
    return out


def _fmt(x: float | None, pct: bool = True) -> str:
    if x is None:
        return "-"
    return f"{100 * x:.1f}" if pct else f"{x:.3f}"


def _table(cells: list[dict[str, Any]], matched: bool) -> str:
    head = ["press", "ratio", "task", "length", "n", "kvpress", "velox", "delta", "agree"]
    head += ["velox matched"] if matched else []
    head += ["kept kvpress", "budget velox", "jaccard q", "jaccard dec"]
    head += ["jaccard matched"] if matched else []
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for c in cells:
        kv, vx = c["kvpress_accuracy"], c["velox_accuracy"]
        delta = None if kv is None or vx is None else vx - kv
        row = [
            c["press"],
            f"{c['ratio']:g}",
            c["task"],
            str(c["length"]),
            str(c["prompts"]),
            _fmt(kv),
            _fmt(vx),
            "-" if delta is None else f"{100 * delta:+.1f}",
            _fmt(c["agreement"]),
        ]
        if matched:
            row.append(_fmt(c.get("matched_accuracy")))
        row += [
            "-" if "kvpress_kept" not in c else f"{c['kvpress_kept']:.0f}",
            "-" if "velox_budget" not in c else f"{c['velox_budget']:.0f}",
            _fmt(c.get("jaccard"), pct=False),
            _fmt(c.get("jaccard_decode"), pct=False),
        ]
        if matched:
            row.append(_fmt(c.get("matched_jaccard"), pct=False))
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description="velox's SnapKV / StreamingLLM / Ada-KV against NVIDIA kvpress's presses on "
        "the long-context suite's prompts",
    )
    ap.add_argument("--model", default="smollm2", help="a velox model name or a .gguf file")
    ap.add_argument("--tasks", nargs="+", default=["passkey", "multikey"])
    ap.add_argument("--lengths", nargs="+", type=int, default=[2048])
    ap.add_argument("--prompts", type=int, default=8, help="prompts per task and length")
    ap.add_argument(
        "--ratios", nargs="+", type=float, default=[0.75, 0.5], help="kvpress compression ratios"
    )
    ap.add_argument("--presses", nargs="+", choices=PRESSES, default=list(PRESSES))
    ap.add_argument("--haystack", default="prose")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--chunk",
        type=int,
        default=0,
        help="velox's prefill chunk (0: the longest of --lengths, each context in one chunk "
        "as kvpress prefills it)",
    )
    ap.add_argument("--jobs", type=int, default=0, help="velox worker processes (0: auto)")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument(
        "--matched",
        action="store_true",
        help="also run velox's methods with kvpress's settings where they differ (MATCHED_SPECS)",
    )
    ap.add_argument(
        "--overlap",
        type=int,
        default=2,
        help="measure kept-position overlap on the first N prompts of each task and length "
        "(0: none; each costs velox one more prefill per spec)",
    )
    ap.add_argument(
        "--kvpress-python",
        default=sys.executable,
        help="python of an environment with kvpress, torch, transformers and gguf",
    )
    ap.add_argument(
        "--kvpress-from",
        metavar="JSON",
        help="reuse the kvpress half of an earlier run's --json output (same prompts)",
    )
    ap.add_argument(
        "--json", help="write the results here (and the kvpress masks beside it, .masks.npz)"
    )
    ap.add_argument("--worker", nargs=2, metavar=("JOB", "OUT"), help=argparse.SUPPRESS)
    a = ap.parse_args(argv)

    if a.worker:
        _kvpress_worker(*a.worker)
        return 0
    for r in a.ratios:
        if not 0 < r < 1:
            ap.error(f"a compression ratio must be in (0, 1), got {r}")
    if a.chunk < 0:
        ap.error(f"--chunk must be 0 (the whole context) or a token count, got {a.chunk}")
    a.chunk = prefill_chunk(a.chunk, a.lengths)
    _preload_blas()
    return _compare(a)


# velox's cuts follow the prefill's chunks (`velox eval --cut chunks`): --chunk 0 is one pass
# over the context, as kvpress's, and a smaller chunk measures mlx-lm's chunked prefill
CUT = "chunks"


def prefill_chunk(chunk: int, lengths: list[int]) -> int:
    """velox's prefill chunk: ``chunk``, or with 0 the longest prompt length, so that each
    context goes through the model in one forward pass, as kvpress's does. A retention
    policy cuts a context prefilled in chunks as each next chunk arrives (``prefill="chunks"``),
    so a later chunk attends to the kept part of the earlier ones in a compressed layer, and
    the layers above it compute other hidden states and keys than one pass over the whole
    context gives (on Gemma 3 at 4,096 tokens in 2,048-token chunks, layers 11 and 17)."""
    return chunk or max(lengths)


def _digest(prompt) -> str:
    """A short hash of a prompt's token ids (an earlier run's kvpress half must match it)."""
    return hashlib.sha256(json.dumps([prompt.context, prompt.question]).encode()).hexdigest()[:16]


def _start_kvpress(
    a: argparse.Namespace, gguf: Path, eos: set[int], prompts: dict, overlap: list, tokenizer
):
    """Starts the kvpress half in ``--kvpress-python`` (``tokenizer``: velox's, whose ids
    KVzipPress gets for its own texts) and returns a function that waits for it and gives its
    output and its kept-position masks; the velox half runs meanwhile (two processes, one
    core each where torch and MLX are given one thread). The function with ``kill=True``
    ends the worker instead (the velox half failed)."""
    tmp = Path(tempfile.mkdtemp(prefix="kvpress-compare-"))
    job = {
        "gguf": str(gguf),
        "eos": sorted(eos),
        "presses": a.presses,
        "ratios": a.ratios,
        "threads": a.threads,
        "overlap": overlap,
        "texts": {t: list(tokenizer.encode(t, add_special_tokens=False)) for t in KVZIP_TEXTS},
        "prompts": [
            {"key": k, "context": p.context, "question": p.question, "max_new": p.max_new}
            for k, p in prompts.items()
        ],
    }
    job_path, out_path = tmp / "job.json", tmp / "kvpress.json"
    job_path.write_text(json.dumps(job))
    # torch brings its own BLAS (not velox's preloaded OpenBLAS); no progress bars
    env = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", "VELOX_BLAS_ACTIVE")}
    env["TQDM_DISABLE"] = "1"
    proc = subprocess.Popen(
        [a.kvpress_python, os.path.abspath(__file__), "--worker", str(job_path), str(out_path)],
        env=env,
    )

    def finish(kill: bool = False):
        try:
            if kill:
                proc.kill()
            rc = proc.wait()
            if kill:
                return None
            if rc != 0:
                raise subprocess.CalledProcessError(rc, proc.args)
            kv = json.loads(out_path.read_text())
            with np.load(out_path.with_suffix(".npz")) as z:
                masks = {name: z[name] for name in z.files}
            return kv, masks
        finally:
            shutil.rmtree(tmp, ignore_errors=True)

    return finish


def _load_kvpress(path: Path, digests: dict[str, str], presses: list[str], ratios: list[float]):
    """The kvpress half of an earlier run's ``--json`` output (and its masks beside it),
    checked to hold every press and ratio asked on the same prompts."""
    old = json.loads(path.read_text())["kvpress"]
    masks: dict[str, np.ndarray] = {}
    if path.with_suffix(".masks.npz").is_file():
        with np.load(path.with_suffix(".masks.npz")) as z:
            masks = {name: z[name] for name in z.files}
    have = {(r["press"], r["ratio"], r["key"]) for r in old["runs"]}
    for key, d in digests.items():
        if old["digests"].get(key) != d:
            raise SystemExit(f"--kvpress-from {path}: prompt {key} is not the one it ran")
        for need in [("none", 0.0), *((n, r) for n in presses for r in ratios)]:
            if (*need, key) not in have:
                raise SystemExit(f"--kvpress-from {path}: no run of {need[0]} at {need[1]}")
    runs = [
        r if r.get("mask", "") in masks else {k: v for k, v in r.items() if k != "mask"}
        for r in old["runs"]
    ]
    return {**old, "runs": runs}, masks


def _key(trial) -> str:
    return f"{trial.task}|{trial.length}|{trial.index}"


def _velox_half(a, model, store, tokenizer, prompts, overlap, spec_of, matched_of, tasks):
    """velox's half: ``run_eval`` (question after the context) on every spec, then the kept
    positions on the ``overlap`` prompts. Returns the trials, run_eval's info, its seconds,
    the kept-position masks and their seconds."""
    from velox_cli.longctx.run import EvalSettings, run_eval, spec_check

    texts = list(dict.fromkeys([*spec_of.values(), *matched_of.values()]))
    settings = EvalSettings(
        tasks=[t.label for t in tasks],
        lengths=list(a.lengths),
        prompts=a.prompts,
        question="after",
        haystack=a.haystack,
        chunk=a.chunk,
        seed=a.seed,
        jobs=a.jobs,
        cut=CUT,
    )
    t = time.perf_counter()
    done = [0]

    def tick(desc: str, n: int) -> None:
        if n:
            done[0] += n
            _log(f"velox: prompt {done[0]}/{len(prompts)} {desc} ({time.perf_counter() - t:.0f} s)")

    trials, info = run_eval([spec_check(s) for s in texts], a.model, settings, progress=tick)
    vx_seconds = time.perf_counter() - t
    for key, p in prompts.items():  # run_eval built the same prompts
        ref = next(tr for tr in trials if tr.spec == "fp16" and _key(tr) == key)
        if ref.tokens != p.tokens or abs(ref.depth - p.depth) > 1e-9:
            raise RuntimeError(f"{key}: run_eval's prompt differs from this script's")

    # kept-position overlap on the first --overlap prompts
    t = time.perf_counter()
    vx_masks: dict[tuple[str, str], tuple] = {}
    for key in overlap:
        for spec in [*spec_of.values(), *matched_of.values()]:
            vx_masks[(spec, key)] = _velox_masks(
                model, store, prompts[key], spec, a.chunk, tokenizer
            )
        _log(f"velox: kept positions of {key} ({time.perf_counter() - t:.0f} s)")
    ov_seconds = time.perf_counter() - t

    return trials, info, vx_seconds, vx_masks, ov_seconds


def _compare(a: argparse.Namespace) -> int:
    from velox_cli.bench import load_model
    from velox_cli.longctx.run import budget_tokens, resolve_spec
    from velox_cli.longctx.tasks import make_prompts, parse_task
    from velox_cli.models import NAMED, gguf_path
    from velox_cli.specs import parse

    t_start = time.perf_counter()
    gguf = gguf_path(a.model) if a.model.lower() in NAMED else Path(a.model).expanduser()
    if gguf.suffix.lower() != ".gguf" or not gguf.is_file():
        raise SystemExit(f"--model {a.model}: both sides load a GGUF; none found at {gguf}")
    model, tokenizer, store, path = load_model(a.model)
    eos = set(getattr(tokenizer, "eos_token_ids", None) or [])
    if getattr(tokenizer, "eos_token_id", None) is not None:
        eos.add(tokenizer.eos_token_id)

    # the suite's prompts, as run_eval builds them
    tasks = [parse_task(t) for t in a.tasks]
    prompts: dict[str, Any] = {}
    for length in a.lengths:
        for task in tasks:
            ps = make_prompts(tokenizer, task, length, a.prompts, haystack=a.haystack, seed=a.seed)
            for i, p in enumerate(ps):
                prompts[f"{p.task}|{length}|{i}"] = p
    overlap = [k for k in prompts if int(k.rsplit("|", 1)[1]) < a.overlap]
    _log(
        f"kvpress_compare: {len(prompts)} prompts ({', '.join(t.label for t in tasks)} at "
        f"{', '.join(map(str, a.lengths))} tokens), ratios {a.ratios}, presses {a.presses}"
    )

    # velox's specs at each ratio
    shares = {r: _share(r) for r in a.ratios}
    spec_of = {(n, r): VELOX_SPECS[n].format(p=shares[r]) for n in a.presses for r in a.ratios}
    matched_of = {}
    if a.matched:
        matched_of = {
            (n, r): MATCHED_SPECS[n].format(p=shares[r])
            for n in a.presses
            if n in MATCHED_SPECS
            for r in a.ratios
        }

    # kvpress's half in its own environment, in the background while velox's runs (or an
    # earlier run's, --kvpress-from)
    digests = {k: _digest(p) for k, p in prompts.items()}
    t_kv = time.perf_counter()
    if a.kvpress_from:
        kv, kv_masks = _load_kvpress(Path(a.kvpress_from), digests, a.presses, a.ratios)
        kv_seconds = time.perf_counter() - t_kv
        kv_finish = None
    else:
        kv_finish = _start_kvpress(a, gguf, eos, prompts, overlap, tokenizer)
    try:
        trials, info, vx_seconds, vx_masks, ov_seconds = _velox_half(
            a, model, store, tokenizer, prompts, overlap, spec_of, matched_of, tasks
        )
    except BaseException:
        if kv_finish is not None:
            kv_finish(kill=True)
        raise
    if kv_finish is not None:
        kv, kv_masks = kv_finish()
        kv["digests"] = digests
        kv_seconds = time.perf_counter() - t_kv
    if "kvzip" in a.presses and "repeat_prompt_ids" in kv["info"]:
        mine = list(tokenizer.encode(KVZIP_PROMPT, add_special_tokens=False))
        same = mine == kv["info"]["repeat_prompt_ids"]
        own = kv["info"].get("own_repeat_prompt_ids", mine) == mine
        _log(
            f"kvpress_compare: KVzip's instruction tokenizes {'alike' if same else 'OTHERWISE'}"
            + ("" if own else " (velox's ids: kvpress's GGUF tokenizer splits it otherwise)")
        )
    kv_runs = {(r["press"], r["ratio"], r["key"]): r for r in kv["runs"]}
    vx = {(tr.spec, _key(tr)): tr for tr in trials}

    def decode(ids: list[int]) -> str:
        return tokenizer.decode(_cut(ids, eos))

    per_prompt, baseline = [], []
    for key, p in prompts.items():
        none = kv_runs[("none", 0.0, key)]
        text = decode(none["ids"])
        ref = vx[("fp16", key)]
        baseline.append(
            {
                "key": key,
                "task": p.task,
                "length": p.length,
                "kvpress_score": p.score(text),
                "kvpress_output": text,
                "velox_score": ref.score if ref.error is None else None,
                "velox_output": ref.output,
            }
        )
        for name in a.presses:
            for ratio in a.ratios:
                run = kv_runs[(name, ratio, key)]
                text = decode(run["ids"])
                tr = vx[(spec_of[(name, ratio)], key)]
                row: dict[str, Any] = {
                    "key": key,
                    "task": p.task,
                    "length": p.length,
                    "depth": p.depth,
                    "press": name,
                    "ratio": ratio,
                    "velox_spec": spec_of[(name, ratio)],
                    "answers": p.answers,
                    "kvpress_score": p.score(text),
                    "kvpress_output": text,
                    "kvpress_kept": run["kept_per_head"],
                    "velox_score": tr.score if tr.error is None else None,
                    "velox_output": tr.output,
                    "velox_error": tr.error,
                    "velox_budget": parse(
                        resolve_spec(spec_of[(name, ratio)], budget_tokens(p, "after"))
                    ).params["budget"],
                }
                if (name, ratio) in matched_of:
                    mt = vx[(matched_of[(name, ratio)], key)]
                    row["matched_spec"] = matched_of[(name, ratio)]
                    row["matched_score"] = mt.score if mt.error is None else None
                    row["matched_output"] = mt.output
                if "mask" in run:
                    km = np.unpackbits(kv_masks[run["mask"]], axis=-1)[..., : len(p.context)]
                    km = km.astype(bool)
                    q, d = vx_masks[(spec_of[(name, ratio)], key)]
                    if q is not None:
                        if km.shape != q.shape:
                            raise RuntimeError(
                                f"{key}: kvpress's kept sets {km.shape} and velox's {q.shape} "
                                "cover different layers"
                            )
                        row["jaccard"] = _jaccard(km, q)
                        row["jaccard_layers"] = _jaccard_layers(km, q)
                        row["jaccard_decode"] = _jaccard(km, d)
                        row["velox_question_kept"] = float(q.sum(-1).mean())
                        row["velox_decode_kept"] = float(d.sum(-1).mean())
                    if (name, ratio) in matched_of:
                        mq, _ = vx_masks[(matched_of[(name, ratio)], key)]
                        if mq is not None:
                            row["matched_jaccard"] = _jaccard(km, mq)
                per_prompt.append(row)

    cells = []
    for name in a.presses:
        for ratio in a.ratios:
            mine = [r for r in per_prompt if r["press"] == name and r["ratio"] == ratio]
            groups: dict[tuple[str, Any], list] = {}
            for r in mine:
                groups.setdefault((r["task"], r["length"]), []).append(r)
            for (task, length), rows in groups.items():
                cells.append({"press": name, "ratio": ratio, "task": task, "length": length})
                cells[-1].update(_cell(rows))
            if len(groups) > 1:
                cells.append({"press": name, "ratio": ratio, "task": "all", "length": "all"})
                cells[-1].update(_cell(mine))
    base_cells = []
    groups = {}
    for r in baseline:
        groups.setdefault((r["task"], r["length"]), []).append(r)
    for (task, length), rows in groups.items():
        base_cells.append({"press": "none / fp16", "ratio": 0.0, "task": task, "length": length})
        base_cells[-1].update(_cell(rows))

    print()
    print("Baseline: kvpress without a press (float32 cache) | velox fp16 cache")
    print(_table(base_cells, False))
    print()
    print(f"Presses (velox at budget = 100 (1 - ratio) % of each prompt; {len(prompts)} prompts)")
    print(_table(cells, bool(matched_of)))
    layers = kv["info"].get("layers")
    for c in cells:
        if "jaccard_layers" in c and layers is not None and len(layers) <= 8:
            each = ", ".join(f"{i}: {j:.3f}" for i, j in zip(layers, c["jaccard_layers"]))
            cell = f"{c['press']} {c['ratio']:g} {c['task']} {c['length']}"
            print(f"jaccard per layer, {cell}: {each}")
    total = time.perf_counter() - t_start
    print(
        f"\ntime: kvpress {kv_seconds:.0f} s, velox {vx_seconds:.0f} s, kept positions "
        f"{ov_seconds:.0f} s, total {total:.0f} s"
    )
    if a.json:
        out = {
            "settings": {
                "model": a.model,
                "gguf": str(gguf),
                "velox_model": str(path),
                "tasks": [t.label for t in tasks],
                "lengths": a.lengths,
                "prompts": a.prompts,
                "ratios": a.ratios,
                "presses": {n: KVPRESS_LABELS[n] for n in a.presses},
                "velox_specs": {f"{n}@{r:g}": s for (n, r), s in spec_of.items()},
                "matched_specs": {f"{n}@{r:g}": s for (n, r), s in matched_of.items()},
                "haystack": a.haystack,
                "seed": a.seed,
                "chunk": a.chunk,
                "question": "after",
                "overlap_prompts": overlap,
            },
            "kvpress": {"info": kv["info"], "digests": kv["digests"], "runs": kv["runs"]},
            "velox_info": info,
            "seconds": {
                "kvpress": round(kv_seconds, 1),
                "velox": round(vx_seconds, 1),
                "kept_positions": round(ov_seconds, 1),
                "total": round(total, 1),
            },
            "baseline": base_cells,
            "cells": cells,
            "per_prompt": per_prompt,
            "baseline_per_prompt": baseline,
        }
        Path(a.json).parent.mkdir(parents=True, exist_ok=True)
        Path(a.json).write_text(json.dumps(out, indent=1))
        np.savez_compressed(Path(a.json).with_suffix(".masks.npz"), **kv_masks)
        print(f"wrote {a.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
